"""``DraftEngine.draft_batch`` (issue 14): a batch of chain and tree requests — different bound
budgets and round budgets, contexts of different lengths, a long first append, a request
joining late — drafts, round after round, exactly what each request drafts alone; a bad item
gets its own error and changes nothing; release returns the pool to idle. On the CPU path
(fast="off", a loop) and the batched fast path (fast="eager": one forward through the Triton
kernels, here in the interpreter at tiny shapes); on a GPU the batch graphs equal the eager
batch and the solo graphs."""
import pytest
import torch
from conftest import DEVICE
from test_fast_draft import CFG, parts

from draft_service.engine import DraftEngine, DraftItem
from modeling.dflash import DFlashConfig
from modeling.errors import FailedPrecondition, InvalidRequest, ResourceExhausted

# one layer, block 4: the interpreter runs every program in Python, so keep rows few
TINY = DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, intermediate_size=48, vocab_size=300, target_layer_ids=(0, 2),
                    mask_token_id=5, block_size=4)
POOL = 1024


def engine(cfg, fast, dtype=torch.float32, device=None, **kw):
    device = device or (DEVICE if fast != "off" else "cpu")  # Triton needs the GPU when there is one
    return DraftEngine(*parts(dtype, cfg, device), max_tree_budget=64, fast=fast, context_pool_tokens=POOL, **kw)


# per request: (mode, bound budget, first round, new rows per round, round budget per round)
PLAN = {"a": ("tree", 20, 0, [6, 2, 4], [None, 5, 0]),    # long first append (6 > block 4)
        "b": ("chain", None, 0, [3, 1, 4], [None, 0, None]),
        "c": ("tree", 6, 0, [2, 4], [3, 6]),                # leaves after round 1
        "d": ("tree", 64, 1, [5, 3], [40, 64])}            # joins at round 1 with a long context


def rounds(cfg, seed=0):
    """Round r's items (each request's features, context start, bonus, and its binding)."""
    g = torch.Generator().manual_seed(seed)
    w, start, out = len(cfg.target_layer_ids) * cfg.hidden_size, {r: 0 for r in PLAN}, []
    for r in range(3):
        items = []
        for rid, (mode, budget, first, ns, rbs) in PLAN.items():
            if not first <= r < first + len(ns):
                continue
            n = ns[r - first]
            bind = dict(mode=mode, budget=budget) if r == first else {}
            items.append(DraftItem(rid, torch.randn(n, w, generator=g), start[rid],
                                   int(torch.randint(0, cfg.vocab_size, (1,), generator=g)),
                                   round_budget=rbs[r - first], **bind))
            start[rid] += n
        out.append(items)
    return out


def check_tree(tokens, parents, item, mode, bound, block):
    want = block if mode == "chain" else (item.round_budget or bound) + 1
    assert len(tokens) == len(parents) == want and tokens[0] == item.bonus and parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(parents) if i)


def solo(eng, items):
    """Each item through ``draft`` alone (raising what it raises)."""
    return [eng.draft(it.request_id, it.features, it.context_start, it.bonus, it.mode, it.budget, it.round_budget)
            for it in items]


@pytest.mark.parametrize("fast", ["off", "eager"])
def test_draft_batch_equals_each_request_alone(fast):
    batched, alone = engine(TINY, fast), engine(TINY, fast)
    w = batched.feature_width
    for r, items in enumerate(rounds(TINY)):
        want = solo(alone, items)
        if r == 1:  # bad items of live requests, alone in a batch: each its own error, nothing changes
            start = {it.request_id: it.context_start for it in items}
            got = batched.draft_batch([DraftItem("a", torch.randn(2, w), 0, 1),  # context out of sync
                                       DraftItem("c", torch.randn(1, w + 1), start["c"], 1),  # feature width
                                       DraftItem("b", torch.randn(1, w), start["b"], 1, round_budget=2)])
            for e, (cls, msg) in zip(got, [(FailedPrecondition, "context_start must be"),
                                           (InvalidRequest, "context_features"),
                                           (InvalidRequest, "round_budget is for tree mode only")]):
                with pytest.raises(cls, match=msg):
                    raise e
        # bad new requests around the round's items, and the first request a second time
        got = batched.draft_batch([DraftItem("new", torch.randn(1, w), 0, 1, "tree", 8, round_budget=9),
                                   *items, DraftItem("new2", torch.randn(1, w), 0, TINY.vocab_size, "tree", 8),
                                   items[0]])
        assert got[1:-2] == want, r
        for e, (cls, msg) in zip([got[0], got[-2], got[-1]], [(InvalidRequest, r"round_budget must be in \[1, 8\]"),
                                                            (InvalidRequest, "bonus_token"),
                                                            (FailedPrecondition, "appears twice")]):
            with pytest.raises(cls, match=msg):
                raise e
        for it, (tokens, parents) in zip(items, want):
            mode, bound = PLAN[it.request_id][:2]
            check_tree(tokens, parents, it, mode, bound, TINY.block_size)
    assert batched.live_requests == 4  # the refused new requests left nothing behind
    assert batched.release(list(PLAN)) == 4 and batched.live_requests == 0
    if fast != "off":
        assert batched.fast.pool.free_pages == batched.fast.pool.pages


def test_draft_batch_limits_are_per_item():
    """max_requests counts the batch's new requests; a full context pool fails only the item
    that needs room; the round budget is checked against each request's own bound."""
    e = engine(TINY, "eager", max_requests=2)
    w = e.feature_width
    f = lambda n: torch.ones(n, w)
    got = e.draft_batch([DraftItem("x", f(2), 0, 3, "tree", 4), DraftItem("y", f(1), 0, 4, "chain"),
                         DraftItem("z", f(1), 0, 5, "chain")])
    assert [type(g) for g in got[:2]] == [tuple, tuple] and isinstance(got[2], ResourceExhausted)
    got = e.draft_batch([DraftItem("x", f(1), 2, 6, round_budget=5), DraftItem("y", f(POOL), 1, 4)])  # y: > the pool
    assert isinstance(got[0], InvalidRequest) and "[1, 4]" in str(got[0]) and isinstance(got[1], ResourceExhausted)
    assert len(e.draft("x", f(1), 2, 6, round_budget=3)[0]) == 4  # x's context is as it was
    assert e.draft("y", f(1), 1, 4)[0][0] == 4  # y's context is as it was: start 1 still fits
    assert e.release(["x", "y"]) == 2 and e.fast.pool.free_pages == e.fast.pool.pages


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_batch_graphs_equal_eager_batch_and_solo_graphs():
    """bf16, the default test drafter shape: batches of 1, 3 and 8 mixed chain / tree requests
    (round budgets ≤ 64, so every bucket ranks with the fused top-K) from the batch graphs ≡
    the eager batch ≡ each request alone from the single-request graphs; then a batch 8 with
    bucket 128 (graphs ≡ eager)."""
    w = 2 * CFG.hidden_size
    g = torch.Generator().manual_seed(2)

    def run(eng, size, budgets, rounds=3, batch=True, bound=64):
        out, start = [], [0] * size
        for r in range(rounds):
            items = []
            for i in range(size):
                mode = "chain" if i % 3 == 1 else "tree"
                n = 20 + i if r == 0 else 1 + (i + r) % CFG.block_size
                bind = dict(mode=mode, budget=bound if mode == "tree" else None) if r == 0 else {}
                rb = budgets[(i + r) % len(budgets)] if mode == "tree" else None
                items.append(DraftItem(f"q{i}", feats[size][r][i][:n], start[i], 7 + i + r, round_budget=rb, **bind))
                start[i] += n
            out.append(eng.draft_batch(items) if batch else solo(eng, items))
        eng.release([f"q{i}" for i in range(size)])
        return out

    feats = {s: [[torch.randn(40, w, generator=g) for _ in range(s)] for _ in range(3)] for s in (1, 3, 8)}
    graphs, eager = (DraftEngine(*parts(torch.bfloat16, CFG, "cuda"), max_tree_budget=512, fast=f,
                                 context_pool_tokens=4096, max_batch=8) for f in ("graphs", "eager"))
    for size in (1, 3, 8):
        got = run(graphs, size, [3, 64, 16, None])
        assert got == run(eager, size, [3, 64, 16, None]), size
        assert got == run(graphs, size, [3, 64, 16, None], batch=False), size
    assert run(graphs, 8, [100, 5], bound=128) == run(eager, 8, [100, 5], bound=128)
    assert graphs.fast.pool.free_pages == graphs.fast.pool.pages
