"""A tiny random Kimi-K2-structured target (MLA + MoE: 1 group, top-2 of 8 experts; FP8
checkpoint) with a random DFlash drafter through the orchestrator's own round loop
(in-process transport, real target and draft engines): every speculative mode's greedy
output equals autoregressive decoding."""
import torch

from deploy.inprocess import InProcessDraft, InProcessTarget, run
from draft_service.engine import DraftEngine
from modeling.dflash import DFlashConfig, DFlashDrafter
from modeling.targets import load_target_model
from modeling.weights import load_embedding_and_head
from orchestrator.generation import GenerationRequest
from scripts.make_tiny_deepseek import TINY, save_tiny
from target_service.engine import TargetEngine
from test_deepseek import one_thread  # noqa: F401  (autouse fixture: one torch thread)


class Tokenizer:
    """Token ids as distinct characters (the tiny model has no tokenizer)."""

    def decode(self, ids):
        return "".join(chr(0x4E00 + i) for i in ids)


def test_speculative_greedy_equals_autoregressive(tmp_path):
    save_tiny(tmp_path, dict(TINY["kimi_k2"], hidden_size=64, n_routed_experts=8, num_experts_per_tok=2), "fp8")
    model = load_target_model(tmp_path, "cpu", torch.float32)
    _, embed, head = load_embedding_and_head(tmp_path)  # what the draft service borrows
    V = model.cfg.vocab_size
    dc = DFlashConfig(hidden_size=model.cfg.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, intermediate_size=64, vocab_size=V,
                      target_layer_ids=(0, 2), mask_token_id=V - 1, block_size=8)
    torch.manual_seed(0)
    drafter = DFlashDrafter(dc).eval().requires_grad_(False)
    target = InProcessTarget(TargetEngine(model, dc.target_layer_ids, 512, 1 << 14, 16))
    draft = InProcessDraft(DraftEngine(drafter, embed, head, max_budget=16))
    prompt = [5, 9, 17, 3, 30, 11, 8, 2]
    out, taus = {}, {}
    for mode, budget in [("autoregressive", 1), ("chain", 1), ("tree", 4), ("tree", 16)]:
        r = run(GenerationRequest("mla", prompt, 40, mode=mode, tree_budget=budget), Tokenizer(), target,
                draft if mode != "autoregressive" else None)
        out[mode, budget], taus[mode, budget] = r.token_ids, r.finished.stats.mean_accept_length
    assert len(out["autoregressive", 1]) == 40
    for key, ids in out.items():
        assert ids == out["autoregressive", 1], key
    assert taus["tree", 16] > 1  # some drafts were accepted, so multi-row commits happened
