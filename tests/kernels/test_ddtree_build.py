"""The one-launch DDTree kernel (``specdec_kernels.ddtree_build``) builds exactly the literal best-first
tree of ``draft_service.ddtree.build_ddtree_reference`` — tokens, parents, depths and float32
scores, node for node, exact score ties included (they pop in push order) — from the same
ranked top-K lists; a capture at a larger capacity truncated to the budget is the budget's tree;
on continuous inputs it equals the batched torch builder the eager path uses.

Random inputs use a fresh seed per test, printed (pytest shows it on failure); reproduce with
DDTREE_SEED=<seed>. CPU (Triton interpreter): small budgets; GPU: budgets 1…512, V = 49152.
"""
import os

import numpy as np
import pytest
import torch
from conftest import DEVICE

from draft_service.ddtree import _log_probs, build_ddtree, build_ddtree_reference
from specdec_kernels.ddtree_build import MAX_BUDGET, build_ddtree_topk

GPU = DEVICE == "cuda"


@pytest.fixture
def rng():
    seed = int(os.environ.get("DDTREE_SEED", np.random.SeedSequence().entropy))
    print(f"DDTREE_SEED={seed}")
    return np.random.default_rng(seed)


def random_logits(rng, R, D, V, ties):
    """[R, D, V] float32; ties=True draws small integers, so log-probs of a depth tie exactly and
    cumulative scores of different paths tie too."""
    if ties:
        return rng.integers(0, 4, (R, D, V)).astype(np.float32)
    return (rng.standard_normal((R, D, V)) * 3).astype(np.float32)


def ranked(logits, K):
    """Top-K log-probs and ids per depth, ties ranked by token id (the reference's order)."""
    lp = _log_probs(torch.from_numpy(logits))
    ids = torch.from_numpy(np.argsort(-lp.numpy(), axis=-1, kind="stable")[..., :K].copy())
    return lp.gather(-1, ids).to(DEVICE), ids.to(DEVICE)


def check_case(rng, budget, D, V, ties, R=2, capacity=None):
    logits = random_logits(rng, R, D, V, ties)
    roots = rng.integers(0, V, R)
    cap = capacity or budget
    top_lp, top_ids = ranked(logits, min(cap, V))
    b = torch.tensor([budget], device=DEVICE) if capacity else budget
    refs = [build_ddtree_reference(logits[r], int(roots[r]), budget) for r in range(R)]
    out = build_ddtree_topk(top_lp, top_ids, torch.from_numpy(roots).to(DEVICE), b, capacity)
    nodes, scores, count = (t.cpu().numpy() for t in out)
    for r, ref in enumerate(refs):
        n = len(ref.tokens)
        assert count[r] == n - 1, (budget, D, V)
        for i, f in enumerate(("tokens", "parents", "depths")):
            assert np.array_equal(nodes[r, i, :n], getattr(ref, f)), (f, budget, D, V, ties)
        assert np.array_equal(scores[r, :n], ref.scores)
        assert np.all(nodes[r, 1, n:budget + 1] == -1)  # unused slots up to the budget


CPU_CASES = [(1, 3, 5, False), (2, 15, 50, True), (7, 4, 3, True), (12, 7, 50, True), (22, 2, 4, True)]


@pytest.mark.parametrize("budget,D,V,ties", CPU_CASES)
def test_matches_literal_reference(rng, budget, D, V, ties):
    check_case(rng, budget, D, V, ties)


def test_capacity_truncates_to_budget(rng):
    """The budget read from device memory: a tree built at capacity 24 (K = 24) for budget 9 is
    the budget-9 tree (K = 9), ties included."""
    check_case(rng, 9, 5, 60, True, R=1, capacity=24)
    check_case(rng, 24, 5, 60, True, R=1, capacity=24)


def test_equals_batched_torch_builder_and_chain(rng):
    """Continuous inputs (no ties): torch.topk + the kernel == ``build_ddtree``; K = 1 at budget D
    is the chain."""
    logits = torch.from_numpy(random_logits(rng, 1, 15, 300, False)).to(DEVICE)
    root = torch.tensor([3], device=DEVICE)
    for budget, K in ((20, 20), (15, 1)):
        top_lp, top_ids = _log_probs(logits).topk(K, dim=-1)
        nodes, scores, _ = build_ddtree_topk(top_lp, top_ids, root, budget)
        tree = build_ddtree(logits, root, budget)[0] if K > 1 else None
        if tree is None:
            assert nodes[0, 0, 1:].tolist() == logits[0].argmax(-1).tolist()
            assert nodes[0, 1].tolist() == list(range(-1, 15))
            continue
        assert torch.equal(nodes[0, 0], tree.tokens) and torch.equal(nodes[0, 1], tree.parents)
        assert torch.equal(nodes[0, 2], tree.depths) and torch.equal(scores[0], tree.scores)


def test_bad_inputs_raise():
    lp, ids = torch.zeros(1, 3, 4, device=DEVICE), torch.zeros(1, 3, 4, dtype=torch.int64, device=DEVICE)
    root = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    for args in [(lp.double(), ids, root, 4), (lp, ids.int(), root, 4), (lp[0], ids[0], root, 4),
                 (lp, ids, root, 0), (lp, ids, root, MAX_BUDGET + 1),
                 (lp, ids, root, torch.tensor([4], device=DEVICE))]:  # tensor budget needs a capacity
        with pytest.raises(ValueError):
            build_ddtree_topk(*args)


@pytest.mark.skipif(not GPU, reason="full sizes on the GPU")
def test_full_size_budgets_1_to_512(rng):
    for budget in [1, 2, 3, 4, 7, 16, 31, 64, 100, 128, 255, 256, 511, 512] + list(rng.integers(1, 513, 6)):
        for ties in (False, True):
            check_case(rng, int(budget), int(rng.choice([1, 3, 7, 15])), int(rng.choice([5, 50, 1000])), ties, R=3)
    for cap in (64, 512):  # graph buckets serving smaller budgets
        check_case(rng, int(rng.integers(1, cap + 1)), 15, 1000, True, capacity=cap)


@pytest.mark.skipif(not GPU, reason="full sizes on the GPU")
def test_full_vocab_bf16_logits(rng):
    """The serving shape: D = 7 (block size 8), V = 49152, logits rounded through bf16 (exact
    token ties)."""
    logits = torch.from_numpy(random_logits(rng, 2, 7, 49152, False)).bfloat16().float().numpy()
    roots = rng.integers(0, 49152, 2)
    for budget in (16, 64, 512):
        top_lp, top_ids = ranked(logits, budget)
        nodes, scores, _ = build_ddtree_topk(top_lp, top_ids, torch.from_numpy(roots).to(DEVICE), budget)
        for r in range(2):
            ref = build_ddtree_reference(logits[r], int(roots[r]), budget)
            assert nodes[r, 0].tolist() == ref.tokens.tolist() and nodes[r, 1].tolist() == ref.parents.tolist()
            assert np.array_equal(scores[r].cpu().numpy(), ref.scores)
