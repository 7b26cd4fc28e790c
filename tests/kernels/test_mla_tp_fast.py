"""The engine's fast path for a tensor-parallel DeepSeek target (modeling.tp: a paged latent pool
and a ``RowInvariantDeepseek`` on every rank, rank 0's commits and forwards mirrored): two ranks
give the same greedy output as the single-rank per-request engine through the orchestrator's
round loop — gloo with the Triton interpreter on CPU (slow tier), NCCL on a two-GPU machine."""
import pytest
import torch

import conftest as kernel_conftest


def interpreter_patches():
    """Each worker rank's first step: the interpreter fixes this directory's conftest applies."""
    import conftest  # noqa: F401


@pytest.mark.cpu_slow
def test_tp2_fast_path_greedy_equals_one_rank(tmp_path):
    from deploy.inprocess import InProcessDraft, InProcessTarget, run
    from draft_service.engine import DraftEngine
    from modeling.dflash import DFlashConfig, DFlashDrafter
    from modeling.targets import load_target_model
    from modeling.tp import launch
    from modeling.weights import load_embedding_and_head
    from orchestrator.generation import GenerationRequest
    from scripts.make_tiny_deepseek import TINY, save_tiny
    from target_service.engine import TargetEngine

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (or none: the interpreter on CPU)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    save_tiny(tmp_path, dict(TINY["kimi_k2"], hidden_size=64, n_routed_experts=8, num_experts_per_tok=2), "fp8")
    taps, prompt = (0, 2), [5, 9, 17, 3, 30, 11, 8, 2]
    model = load_target_model(tmp_path, "cpu", torch.float32)
    _, embed, head = load_embedding_and_head(tmp_path)
    V = model.cfg.vocab_size
    torch.manual_seed(0)
    drafter = DFlashDrafter(DFlashConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=64, vocab_size=V, target_layer_ids=taps, mask_token_id=V - 1, block_size=8)).eval()
    draft = InProcessDraft(DraftEngine(drafter.requires_grad_(False), embed, head, max_tree_budget=16))

    class Tokens:
        def decode(self, ids):
            return "".join(chr(0x4E00 + i) for i in ids)

    def generate(target, mode, budget):
        req = GenerationRequest("tp", prompt, 16, mode=mode, tree_budget=budget)
        r = run(req, Tokens(), target, draft if mode != "autoregressive" else None)
        taus.append(r.finished.stats.mean_accept_length)
        return r.token_ids

    taus = []
    ref = generate(InProcessTarget(TargetEngine(model, taps, 256, 1 << 12, 16)), "autoregressive", 1)
    driver = launch(str(tmp_path), 2, device, dtype, row_invariant=True, worker_init=interpreter_patches)
    try:
        with pytest.raises(ValueError, match="eagerly"):
            TargetEngine(driver, taps, 256, 1 << 12, 16, fast="graphs", kv_page_rows=64)
        engine = TargetEngine(driver, taps, 256, 1 << 12, 16, fast="eager", kv_page_rows=64, prefill_chunk=16)
        target = InProcessTarget(engine)
        assert generate(target, "autoregressive", 1) == ref
        assert generate(target, "tree", 16) == ref
        assert taus[-1] > 1  # drafts accepted: multi-row commits mirrored on the other rank (in the forward)
        engine._max_moves = 0  # now every commit by the host (PagedCache.commit → copy_rows), mirrored too
        assert generate(target, "tree", 16) == ref and taus[-1] > 1
        assert engine.live_requests == 0 and engine.reserved_tokens == 0
    finally:
        driver.stop()
    assert kernel_conftest.DEVICE == device
