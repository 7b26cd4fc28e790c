"""Tests for draft_service.ddtree (DDTree best-first draft trees).

Random inputs use a fresh seed per test; the seed is printed (shown by pytest on failure).
Reproduce with DDTREE_SEED=<seed> python -m pytest tests/draft_service/test_ddtree.py
"""

import itertools
import os

import numpy as np
import pytest
import torch

from draft_service.ddtree import DraftTree, build_chain, build_ddtree, build_ddtree_reference

BUDGETS = [1, 2, 3, 4, 7, 16, 31, 64, 100, 256, 512]
DEPTHS = [1, 3, 7, 15]
VOCABS = [5, 50, 1000]


@pytest.fixture
def rng():
    seed = int(os.environ.get("DDTREE_SEED", np.random.SeedSequence().entropy))
    print(f"DDTREE_SEED={seed}")
    return np.random.default_rng(seed)


def random_logits(rng, R, D, V):
    """Continuous random logits [R, D, V] float32 (exact ties practically never occur)."""
    return torch.from_numpy((rng.standard_normal((R, D, V)) * 3).astype(np.float32))


def log_probs_f32(logits_dv):
    """[D, V] -> float32 log-probs exactly as the builders compute them."""
    return torch.log_softmax(torch.as_tensor(logits_dv).float(), -1).clamp_max(0.0).numpy()


def log_probs_f64(logits_dv):
    x = np.asarray(logits_dv, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def expected_count(budget, D, V):
    K = min(budget, V)
    return min(budget, sum(K**d for d in range(1, D + 1)))


def as_np(tree):
    return DraftTree(*(np.asarray(getattr(tree, f)) for f in ("tokens", "parents", "depths", "visibility", "scores")))


def paths(tree):
    """Token path (tuple, root excluded) of every node."""
    out = [()]
    for i in range(1, len(tree.tokens)):
        out.append(out[tree.parents[i]] + (int(tree.tokens[i]),))
    return out


def check_tree(tree, logits_dv, root, budget):
    """Structural invariants plus optimality of the node set (no brute force needed)."""
    t = as_np(tree)
    D, V = logits_dv.shape
    lp = log_probs_f32(logits_dv)
    n = len(t.tokens)
    assert n - 1 == expected_count(budget, D, V)
    assert t.tokens.dtype == t.parents.dtype == t.depths.dtype == np.int64
    assert t.scores.dtype == np.float32 and t.visibility.dtype == np.bool_
    assert t.parents.shape == t.depths.shape == t.scores.shape == (n,)
    assert t.visibility.shape == (n, n)
    assert t.tokens[0] == root and t.parents[0] == -1 and t.depths[0] == 0 and t.scores[0] == 0.0
    idx = np.arange(1, n)
    assert np.all((t.parents[1:] >= 0) & (t.parents[1:] < idx)), "parents must precede children"
    assert np.array_equal(t.depths[1:], t.depths[t.parents[1:]] + 1)
    assert np.all((t.depths[1:] >= 1) & (t.depths[1:] <= D))
    assert np.all((t.tokens[1:] >= 0) & (t.tokens[1:] < V))
    pairs = set(zip(t.parents[1:].tolist(), t.tokens[1:].tolist()))
    assert len(pairs) == n - 1, "siblings must carry distinct tokens"
    # Scores: exact float32 accumulation, close to float64 path log-probs, best-first order.
    expect = t.scores[t.parents[1:]] + lp[t.depths[1:] - 1, t.tokens[1:]]
    assert np.array_equal(t.scores[1:], expect)
    lp64 = log_probs_f64(logits_dv)
    s64 = [sum(lp64[d, tok] for d, tok in enumerate(p)) for p in paths(t)]
    np.testing.assert_allclose(t.scores, s64, rtol=1e-4, atol=1e-4)
    assert np.all(np.diff(t.scores) <= 0), "nodes must be in best-first order"
    # Visibility = ancestor-or-self relation by walking parents.
    vis = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = t.parents[j]
    assert np.array_equal(t.visibility, vis)
    # Optimality: the best prefix outside the tree (always a frontier child of a tree node)
    # scores no higher than the worst node in the tree.
    children = {}
    for p, tok in pairs:
        children.setdefault(p, set()).add(tok)
    order = np.argsort(-lp, axis=1, kind="stable")
    best_out = -np.inf
    for p in range(n):
        if t.depths[p] < D:
            free = [tok for tok in order[t.depths[p]] if tok not in children.get(p, ())]
            if free:
                best_out = max(best_out, t.scores[p] + lp[t.depths[p], free[0]])
    assert t.scores[1:].min() >= best_out


def assert_same_tree(got, ref):
    """Equal to the reference; with exact score ties only tied prefixes may swap."""
    got, ref = as_np(got), as_np(ref)
    assert np.array_equal(got.scores, ref.scores)
    if len(np.unique(ref.scores[1:])) == len(ref.scores) - 1:  # no ties: exact equality
        for f in ("tokens", "parents", "depths", "visibility"):
            assert np.array_equal(getattr(got, f), getattr(ref, f)), f
        return
    gp, rp = paths(got), paths(ref)
    last = ref.scores[-1]  # at the boundary score, tied prefixes may be picked differently
    for s in np.unique(ref.scores[1:]):
        if s != last:
            sel = ref.scores == s
            assert sorted(np.array(gp, dtype=object)[sel]) == sorted(np.array(rp, dtype=object)[sel])


def run_case(rng, budget, D, V, R):
    logits = random_logits(rng, R, D, V)
    roots = torch.from_numpy(rng.integers(0, V, size=R))
    trees = build_ddtree(logits, roots, budget)
    assert len(trees) == R
    for r in range(R):
        ref = build_ddtree_reference(logits[r].numpy(), int(roots[r]), budget)
        check_tree(trees[r], logits[r].numpy(), int(roots[r]), budget)
        check_tree(ref, logits[r].numpy(), int(roots[r]), budget)
        assert_same_tree(trees[r], ref)


@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("D", DEPTHS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_matches_reference(rng, budget, D, V):
    run_case(rng, budget, D, V, R=int(rng.choice([1, 3])))


def test_matches_reference_random_budgets(rng):
    for _ in range(6):
        run_case(rng, int(rng.integers(1, 513)), int(rng.choice(DEPTHS)), int(rng.choice(VOCABS)), int(rng.choice([1, 3])))


@pytest.mark.parametrize(
    "V,D,budget,count",
    [(2, 3, 100, 14), (2, 3, 14, 14), (2, 3, 13, 13), (1, 4, 10, 4), (5, 3, 512, 155), (1000, 1, 512, 512)],
)
def test_node_count(rng, V, D, budget, count):
    logits = random_logits(rng, 2, D, V)
    trees = build_ddtree(logits, torch.zeros(2, dtype=torch.long), budget)
    for r, tree in enumerate(trees):
        assert len(tree.tokens) == count + 1
        check_tree(tree, logits[r].numpy(), 0, budget)


def test_brute_force_top_budget(rng):
    V, D = 3, 3
    prefixes = [p for d in range(1, D + 1) for p in itertools.product(range(V), repeat=d)]
    assert len(prefixes) == 39
    for budget in range(1, 42):
        while True:
            logits = random_logits(rng, 1, D, V)
            lp = log_probs_f64(logits[0].numpy())
            score = {p: sum(lp[d, tok] for d, tok in enumerate(p)) for p in prefixes}
            ranked = sorted(prefixes, key=lambda p: -score[p])
            if budget >= len(ranked) or score[ranked[budget - 1]] - score[ranked[budget]] > 1e-4:
                break  # no near-tie at the boundary
        tree = build_ddtree(logits, torch.tensor([7]), budget)[0]
        assert set(paths(as_np(tree))[1:]) == set(ranked[:budget])


def test_exact_ties_still_valid():
    # All log-probs equal: every prefix of a depth ties; trees must still be valid and optimal.
    logits = torch.zeros(2, 3, 4)
    for budget in (1, 5, 20, 84, 100):
        for tree in build_ddtree(logits, torch.tensor([1, 2]), budget):
            check_tree(tree, logits[0].numpy(), int(tree.tokens[0]), budget)
        check_tree(build_ddtree_reference(logits[0].numpy(), 1, budget), logits[0].numpy(), 1, budget)


def test_low_precision_inputs(rng):
    logits = random_logits(rng, 3, 7, 50)
    roots = torch.tensor([1, 2, 3])
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        low = logits.to(dtype)
        for a, b in zip(build_ddtree(low, roots, 64), build_ddtree(low.float(), roots, 64)):
            for f in ("tokens", "parents", "depths", "visibility", "scores"):
                assert torch.equal(getattr(a, f), getattr(b, f))
            assert a.scores.dtype == torch.float32


def test_chain_is_argmax_path(rng):
    R, D, V = 3, 7, 50
    logits = random_logits(rng, R, D, V)
    roots = torch.tensor([4, 5, 6])
    lp = torch.log_softmax(logits, -1)
    for length in (None, 1, 4, D):
        n = D if length is None else length
        for r, tree in enumerate(build_chain(logits, roots, length)):
            assert tree.tokens.tolist() == [int(roots[r])] + logits[r, :n].argmax(-1).tolist()
            assert tree.parents.tolist() == list(range(-1, n))
            assert tree.depths.tolist() == list(range(n + 1))
            assert torch.equal(tree.visibility, torch.ones(n + 1, n + 1, dtype=torch.bool).tril())
            expect = torch.cat([torch.zeros(1), lp[r, :n].max(-1).values.cumsum(0)])
            torch.testing.assert_close(tree.scores, expect)
    # The chain is the first path of any DDTree (its first node is the top-1 at depth 1).
    assert torch.equal(build_chain(logits, roots, 1)[0].tokens, build_ddtree(logits, roots, 1)[0].tokens)


def test_chain_equals_ddtree_with_k1(rng):
    # One dominant token per depth: log-probs round to 0.0 in float32, so child scores equal
    # their parent's; the DDTree with budget D must still be the chain in depth order.
    R, D, V = 2, 6, 30
    logits = random_logits(rng, R, D, V)
    logits.scatter_(-1, torch.from_numpy(rng.integers(0, V, (R, D, 1))), 200.0)
    roots = torch.tensor([0, 1])
    for a, b in zip(build_chain(logits, roots), build_ddtree(logits, roots, D)):
        for f in ("tokens", "parents", "depths", "visibility", "scores"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
    # V = 1: the DDTree is exactly the chain.
    one = torch.randn(2, 5, 1)
    for a, b in zip(build_chain(one, roots), build_ddtree(one, roots, 100)):
        for f in ("tokens", "parents", "depths", "visibility", "scores"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("budget", [0, -1, 1.5, True, None])
def test_bad_budget_raises(budget):
    with pytest.raises(ValueError):
        build_ddtree(torch.randn(1, 3, 5), torch.tensor([0]), budget)
    with pytest.raises(ValueError):
        build_ddtree_reference(np.zeros((3, 5), np.float32), 0, budget)


@pytest.mark.parametrize(
    "logits,roots",
    [
        (torch.randn(3, 5), torch.tensor([0])),  # missing batch dim
        (torch.randn(2, 3, 5), torch.tensor([0])),  # root count mismatch
        (torch.randn(2, 3, 5), torch.tensor([[0, 1]])),  # root shape
        (torch.randn(1, 3, 5), torch.tensor([0.0])),  # float roots
        (torch.ones(1, 3, 5, dtype=torch.long), torch.tensor([0])),  # integer logits
        (torch.randn(1, 0, 5), torch.tensor([0])),  # D = 0
        (torch.randn(1, 3, 0), torch.tensor([0])),  # V = 0
    ],
)
def test_bad_shapes_raise(logits, roots):
    with pytest.raises(ValueError):
        build_ddtree(logits, roots, 4)
    with pytest.raises(ValueError):
        build_chain(logits, roots)


def test_bad_chain_length_raises():
    for length in (0, 4, -2):
        with pytest.raises(ValueError):
            build_chain(torch.randn(1, 3, 5), torch.tensor([0]), length)
    with pytest.raises(ValueError):
        build_ddtree_reference(np.zeros((2, 3, 5), np.float32), 0, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(rng):
    logits = random_logits(rng, 3, 7, 1000)
    roots = torch.tensor([1, 2, 3])
    for a, b in zip(build_ddtree(logits.cuda(), roots.cuda(), 256), build_ddtree(logits, roots, 256)):
        assert a.tokens.device.type == "cuda"
        assert torch.equal(a.tokens.cpu(), b.tokens) and torch.equal(a.parents.cpu(), b.parents)
        assert torch.equal(a.visibility.cpu(), b.visibility)
        torch.testing.assert_close(a.scores.cpu(), b.scores)
