"""Tensor parallel DeepSeek-V3 / Kimi-K2 target on CPU (gloo): TP=2 gives the same greedy
tokens as TP=1 and logits within 1e-5, through the rank-0 driver the target engine uses
(worker ranks mirror every call on their own latent-cache replicas), also inside the
orchestrator's round loop; a dead rank is reported; each rank loads only its share."""
import pytest
import torch

from deploy.inprocess import InProcessTarget
from modeling.deepseek_weights import load_deepseek
from modeling.llama import causal_mask, tree_mask
from modeling.tree import tree_ancestors, visibility
from scripts.make_tiny_deepseek import save_tiny
from target_service.engine import TargetEngine
from test_deepseek import one_thread  # noqa: F401  (autouse fixture: one torch thread)
from test_deepseek_pipeline import TAPS, generate, stack  # noqa: F401  (stack: module fixture)


@torch.inference_mode()
def greedy_rounds(model) -> tuple[list[int], torch.Tensor]:
    """Prefill, 3 one-row decodes, a tree verify + commit of a 4-row path, 2 more decodes,
    as the target engine drives a model. Returns the greedy tokens and every logits row (CPU)."""
    dev = model.lm_head.weight.device

    def t(x):
        return torch.tensor(x, device=dev)

    cache = model.new_cache(64)
    prompt = [5, 9, 17, 3, 30, 11, 8, 2, 40, 7, 19, 21]
    T = len(prompt)
    h, _ = model(t(prompt), torch.arange(T, device=dev), cache, causal_mask(0, T, dev), (0, 2))
    cache.length = T
    rows = [model.logits(h[-1:])]
    out = [int(rows[-1].argmax())]
    for step in range(6):
        L = cache.length
        if step == 3:  # a tree: root = the pending token, siblings and a chain
            parents = [-1, 0, 0, 1, 3, 2, 0]
            tokens = [out[-1], out[-1] % 50, 44, 12, 13, 14, 45]
            depths, anc = tree_ancestors(parents)
            h, _ = model(t(tokens), L + torch.from_numpy(depths).to(dev), cache,
                         tree_mask(L, torch.from_numpy(visibility(depths, anc)).to(dev)), (0, 2))
            lg = model.logits(h)
            rows.append(lg)
            path = [0, 1, 3, 4]  # committed as if accepted: exercises a multi-row commit
            cache.commit(t(path))
            out += [tokens[j] for j in path[1:]] + [int(lg[path[-1]].argmax())]
            continue
        h, _ = model(t(out[-1:]), t([L]), cache, causal_mask(L, 1, dev), (0, 2))
        cache.commit(t([0]))
        rows.append(model.logits(h))
        out.append(int(rows[-1].argmax()))
    return out, torch.cat(rows).cpu()


def test_tp2_on_cpu(stack):
    """One launch of two gloo ranks: (1) the same greedy tokens as TP=1 and logits within 1e-5
    through prefill, decodes, a tree verify and a multi-row commit; (2) the same greedy output
    in the orchestrator's round loop (AR and tree@16); (3) killing the worker is reported by
    ``watch`` and makes the next call raise."""
    import threading

    from modeling.tp import launch

    path, target, draft = stack
    want_tokens, want_logits = greedy_rounds(load_deepseek(path))
    ref, _ = generate(target, draft, "autoregressive", 1, 30)
    driver = launch(str(path), 2)
    try:
        assert driver.alive()
        got_tokens, got_logits = greedy_rounds(driver)
        assert driver.model.model.layers[0].self_attn.h == 2  # really sharded
        assert driver.model.lm_head.weight.shape[0] == driver.cfg.vocab_size // 2
        assert got_tokens == want_tokens
        err = (got_logits - want_logits).abs().max().item()
        print(f"TP=2 vs TP=1 max |Δlogit| {err:.2e} over {len(got_logits)} rows")
        assert err <= 1e-5

        tp = InProcessTarget(TargetEngine(driver, TAPS, 512, 1 << 14, 16))
        assert generate(tp, draft, "autoregressive", 1, 30)[0] == ref
        assert generate(tp, draft, "tree", 16, 30)[0] == ref

        seen, fired = [], threading.Event()
        driver.watch(lambda dead: (seen.append(dead), fired.set()), interval=0.1)
        driver._processes[0].kill()  # the worker this test started
        assert fired.wait(10) and seen == [[1]]
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] died"):
            driver.new_cache(8)
    finally:
        driver.stop()


def test_loader_reads_only_the_ranks_share(tmp_path):
    """A rank's weights straight from the loader equal the full model sharded afterwards."""
    from modeling.tp import shard_

    save_tiny(tmp_path, "deepseek_v3", "fp8")
    full = shard_(load_deepseek(tmp_path), 1, 2)
    part = load_deepseek(tmp_path, rank=1, world=2)
    want, got = dict(full.named_parameters()), dict(part.named_parameters())
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert got["model.layers.1.self_attn.kv_b_proj.weight"].shape == (2 * 32, 32)  # 2 of 4 heads
    assert got["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (64, 12)
    with pytest.raises(ValueError, match="cannot be split over 3 ranks"):
        load_deepseek(tmp_path, rank=0, world=3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_on_two_gpus_nccl(tmp_path):
    """The same over NCCL with the row-invariant kernels on each GPU (fp32 so that the logits
    bound is the issue's 1e-5; greedy tokens must match exactly)."""
    from modeling.deepseek_fast import row_invariant_
    from modeling.tp import launch

    save_tiny(tmp_path, "kimi_k2", "fp8")
    want_tokens, want_logits = greedy_rounds(row_invariant_(load_deepseek(tmp_path, "cuda:0")))
    driver = launch(str(tmp_path), 2, "cuda", torch.float32, row_invariant=True)
    try:
        got_tokens, got_logits = greedy_rounds(driver)
    finally:
        driver.stop()
    err = (got_logits - want_logits).abs().max().item()
    print(f"NCCL TP=2 vs TP=1 max |Δlogit| {err:.2e} over {len(got_logits)} rows")
    assert got_tokens == want_tokens and err <= 1e-5
