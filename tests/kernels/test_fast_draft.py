"""The pool-backed drafter (``draft_service.fast_draft``) proposes the same trees as the
reference ``DraftEngine`` over several rounds of one request, and on a GPU its CUDA-graph
replay equals its eager run (including budget buckets truncated to the request's budget)."""
import pytest
import torch
from conftest import DEVICE

from draft_service.engine import DraftEngine
from draft_service.fast_draft import GraphedDrafter
from modeling.dflash import DFlashConfig, DFlashDrafter

CFG = DFlashConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, intermediate_size=96, vocab_size=300, target_layer_ids=(0, 2),
                   mask_token_id=5, block_size=8)


def parts(dtype, cfg=CFG, device=DEVICE):
    """A random drafter (seed 0, non-trivial norm weights), embedding and LM head on ``device``."""
    torch.manual_seed(0)
    d = DFlashDrafter.random(cfg, 1)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.5 * (p.dim() == 1))  # non-trivial norm weights
    d = d.to(device, dtype).eval().requires_grad_(False)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size).to(device, dtype)
    return d, embed, torch.randn(cfg.vocab_size, cfg.hidden_size).to(device, dtype)


def rounds(seed=0):
    """(features, bonus, mode, budget) per round: a 37-row prompt, then 1..8 new rows."""
    g = torch.Generator().manual_seed(seed)
    out, w = [], 2 * CFG.hidden_size
    for r, n in enumerate([37, 3, 8, 1, 5, 2]):
        out.append((torch.randn(n, w, generator=g), int(torch.randint(0, 300, (1,), generator=g)), r))
    return out


def run_fast(fast, rid, mode, budget):
    fast.new_context(rid, 0)
    trees = [fast.draft(rid, f, b, mode, budget) for f, b, _ in rounds()]
    fast.release(rid)
    return trees


@pytest.mark.parametrize("mode,budget,fused", [pytest.param("chain", 0, True, marks=pytest.mark.slow), ("tree", 10, True),
                                               pytest.param("tree", 64, False, marks=pytest.mark.slow)])  # CI time
def test_fast_drafter_matches_reference_engine(mode, budget, fused):
    """fused: the tree from top-K + the one-launch kernel (specdec_kernels.ddtree_build; the GPU default;
    budget 10 is built at the 16 bucket's capacity) instead of the batched torch builder (the
    CPU default)."""
    d, embed, head = parts(torch.float32)
    ref = DraftEngine(d, embed, head, max_tree_budget=64)
    fast = GraphedDrafter(d, embed, head, pool_rows=4096, max_tree_budget=64, graphs=False, fused_tree=fused)
    start, want = 0, []
    for f, b, _ in rounds():
        want.append(ref.draft("r", f, start, b, mode, budget or 1))
        start += f.shape[0]
    assert run_fast(fast, "x", mode, budget or 1) == want
    assert fast.pool.free_pages == fast.pool.pages  # released


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graph_replay_equals_eager_drafter():
    d, embed, head = parts(torch.bfloat16)
    eager = GraphedDrafter(d, embed, head, pool_rows=4096, max_tree_budget=512, graphs=False)
    graphed = GraphedDrafter(d, embed, head, pool_rows=4096, max_tree_budget=512, graphs=True)
    for mode, budget in [("tree", 512), ("tree", 3), ("chain", 1), ("tree", 100), ("tree", 16)]:
        assert run_fast(graphed, "g", mode, budget) == run_fast(eager, "e", mode, budget), (mode, budget)


@pytest.mark.cpu_slow  # CI time: ~10 s in the interpreter; runs in every GPU run
def test_draft_engine_fast_path_matches_eager_engine():
    """DraftEngine(fast="eager") (pool + fast drafter) serves the same trees as the eager
    engine, keeps context sync checks, and frees the pool on release."""
    d, embed, head = parts(torch.float32)
    engines = [DraftEngine(d, embed, head, max_tree_budget=64, fast=f, context_pool_tokens=2048) for f in ("off", "eager")]
    outs = []
    for e in engines:
        start, trees = 0, []
        for f, b, _ in rounds(3):
            trees.append(e.draft("r", f, start, b, "tree", 20))
            start += f.shape[0]
        outs.append(trees)
        with pytest.raises(Exception, match="context_start"):
            e.draft("r", f, start + 1, b)
        assert e.release(["r"]) == 1
    assert outs[0] == outs[1]
    assert engines[1].fast.pool.free_pages == engines[1].fast.pool.pages


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_graphed_fused_tree_equals_eager_torch_builder():
    """fp32 drafter (no score ties in practice): the graphs with the fused DDTree kernel propose
    the trees of the eager path with the batched torch builder, across budget buckets."""
    d, embed, head = parts(torch.float32)
    eager = GraphedDrafter(d, embed, head, pool_rows=4096, max_tree_budget=512, graphs=False, fused_tree=False)
    graphed = GraphedDrafter(d, embed, head, pool_rows=4096, max_tree_budget=512, graphs=True)
    assert graphed.fused_tree
    for mode, budget in [("tree", 512), ("tree", 3), ("chain", 1), ("tree", 100), ("tree", 16)]:
        assert run_fast(graphed, "g", mode, budget) == run_fast(eager, "e", mode, budget), (mode, budget)
