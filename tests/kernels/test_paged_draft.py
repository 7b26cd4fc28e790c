"""The drafter's context in pages (issue 14 item 2, plans/0009 "Session 6"): requests joining and
leaving over rounds, solo rounds (the single-request path: ``meta``'s table offset) and batched
ones (``row_meta``), contexts spread over shuffled pages of 8 rows, draft exactly the trees of
the contiguous layout (one page per request, larger than its context: one run of rows, what
the contiguous ``KVPool`` gave) and hold bitwise the same context K/V; pages and page tables return to idle
after release, cancellation and failure; a full pool refuses only the request that needs a page
now (RESOURCE_EXHAUSTED, its context unchanged) and one that can never fit names
context_pool_tokens. On CPU through the Triton interpreter (fast="eager"); on a GPU also in
bf16 from CUDA graphs."""
import random

import pytest
import torch
from conftest import DEVICE
from test_draft_batch import TINY, solo
from test_fast_draft import CFG, parts

from draft_service.engine import DraftEngine, DraftItem
from modeling.errors import ResourceExhausted

POOL = 256


def engine(cfg, page_rows, fast="eager", dtype=torch.float32, pool=POOL, **kw):
    e = DraftEngine(*parts(dtype, cfg, DEVICE), max_tree_budget=64, fast=fast, context_pool_tokens=pool,
                    context_page_rows=page_rows, **kw)
    random.Random(page_rows).shuffle(e.fast.pool._free)  # pages handed out in no order
    return e


def idle(e) -> bool:
    f = e.fast
    return (e.live_requests == 0 and f.pool.free_pages == f.pool.pages and not f.ctx
            and len(f._free_tables) == e.max_requests)


def context_kv(e, rid):
    """The request's context K/V [layers, length, g, d] gathered from the pool by position."""
    c = e.fast.ctx[rid]
    rows = torch.as_tensor(c.rows(range(c.length)), device=e.fast.pool.k.device)
    return e.fast.pool.k[:, rows], e.fast.pool.v[:, rows]


# per round, the requests drafting (rid, new rows); a request's first round binds its mode
SCHEDULE = [[("a", 16)], [("a", 2), ("b", 3), ("c", 1)], [("a", 4), ("c", 6), ("d", 9)], [("d", 2)]]
MODES = {"a": ("tree", 12), "b": ("chain", None), "c": ("tree", 5), "d": ("tree", 30)}
LEAVE = {1: ["a", "b"]}  # after round r, these leave (a returns as a new request in round 2)


def rounds(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, start, out = len(cfg.target_layer_ids) * cfg.hidden_size, {}, []
    for r, step in enumerate(SCHEDULE):
        items = []
        for rid, n in step:
            bind = dict(zip(("mode", "budget"), MODES[rid])) if rid not in start else {}
            items.append(DraftItem(rid, torch.randn(n, w, generator=g), start.get(rid, 0),
                                   int(torch.randint(0, cfg.vocab_size, (1,), generator=g)), **bind))
            start[rid] = start.get(rid, 0) + n
        for rid in LEAVE.get(r, []):
            start.pop(rid)
        out.append(items)
    return out


def test_paged_context_drafts_equal_contiguous():
    """Pages of 8 rows (≤ 3 a request, shuffled; a round's rows within one page or across two)
    vs one 64-row page per request (contexts ≤ 22 rows): the same trees round after round, the
    same context K/V bit for bit, pages spread out."""
    paged, contiguous = engine(TINY, 8), engine(TINY, 64)
    assert paged.fast.table_pages == POOL // 8
    scattered = False
    for r, items in enumerate(rounds(TINY)):
        got = paged.draft_batch(items)
        assert got == contiguous.draft_batch(items), r
        assert all(isinstance(t, tuple) for t in got), got
        for it in items:
            assert len(contiguous.fast.ctx[it.request_id].pages) == 1
            pages = paged.fast.ctx[it.request_id].pages
            scattered |= any(b != a + 1 for a, b in zip(pages, pages[1:]))
            for x, y in zip(context_kv(paged, it.request_id), context_kv(contiguous, it.request_id)):
                assert torch.equal(x, y), (r, it.request_id)
        for e in (paged, contiguous):
            e.release(LEAVE.get(r, []))
    assert scattered  # the test covered non-adjacent pages
    for e in (paged, contiguous):
        e.release(list(MODES))
        assert idle(e)


def test_full_pool_refuses_only_the_request_that_needs_a_page():
    """A pool of 6 pages of 4 rows (block 4): a request that needs a page when none is free gets
    RESOURCE_EXHAUSTED and keeps its context (it drafts again once pages return); a new one that
    cannot get its pages leaves nothing; one that could never fit names context_pool_tokens; a
    cancelled request (release mid-generation) and failures return every page."""
    e = engine(TINY, 4, pool=24)
    w = e.feature_width
    f = lambda n: torch.ones(n, w)
    assert [type(t) for t in e.draft_batch([DraftItem("x", f(7), 0, 1, "tree", 8),     # 7 + 4 rows: 3 pages
                                            DraftItem("y", f(4), 0, 2, "chain")])] == [tuple, tuple]  # 2 pages
    assert e.fast.pool.free_pages == 1
    # z (new, 9 rows: 3 pages) is refused at creation; y (11 rows: 3 pages) takes the last page;
    # x (13 rows: 4 pages) then finds none
    got = e.draft_batch([DraftItem("y", f(3), 4, 4), DraftItem("x", f(2), 7, 3), DraftItem("z", f(5), 0, 5, "chain")])
    assert isinstance(got[1], ResourceExhausted) and "context pool full" in str(got[1])
    assert "context_pool_tokens 24" in str(got[1])
    assert isinstance(got[0], tuple) and isinstance(got[2], ResourceExhausted)
    assert e.live_requests == 2 and e.fast.pool.free_pages == 0
    big = e.draft_batch([DraftItem("big", f(21), 0, 6, "chain")])[0]  # 21 + 4 rows > 24: can never fit
    assert isinstance(big, ResourceExhausted) and "never fit" in str(big) and "context_pool_tokens 24" in str(big)
    assert e.release(["y"]) == 1  # y cancelled: its pages come back
    assert len(e.draft("x", f(2), 7, 3)[0]) == 9  # x's context was as it was: start 7 still fits
    assert e.release(["x", "z"]) == 1 and idle(e)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("page_rows", [16, 128])
def test_paged_graphs_equal_contiguous_graphs_bf16(page_rows):
    """bf16, the default test drafter shape, CUDA graphs (solo and batch buckets): contexts in
    shuffled pages of page_rows rows draft the trees of the contiguous layout (one 512-row page
    per request), solo and batched, eager and graphed; K/V bitwise; back to idle."""
    w = 2 * CFG.hidden_size
    g = torch.Generator().manual_seed(3)
    sizes = [1, 3, 8, 5]  # requests per round: growing, then some leave
    feats = [[torch.randn(150, w, generator=g) for _ in range(8)] for _ in sizes]

    def run(e, batch=True):
        out, start = [], [0] * 8
        for r, size in enumerate(sizes):
            items = []
            for i in range(size):
                mode = "chain" if i % 3 == 1 else "tree"
                n = 140 - 10 * i if start[i] == 0 else 1 + (i + r) % CFG.block_size
                bind = dict(mode=mode, budget=64 if mode == "tree" else None) if start[i] == 0 else {}
                items.append(DraftItem(f"q{i}", feats[r][i][:n], start[i], 7 + i + r,
                                       round_budget=[3, 64, 16][(i + r) % 3] if mode == "tree" else None, **bind))
                start[i] += n
            out.append(e.draft_batch(items) if batch else solo(e, items))
            if r == len(sizes) - 1:
                kv = [context_kv(e, it.request_id) for it in items]
        e.release([f"q{i}" for i in range(8)])
        assert idle(e)
        return out, kv

    mk = lambda pr, fast: DraftEngine(*parts(torch.bfloat16, CFG, "cuda"), max_tree_budget=64, fast=fast,
                                      context_pool_tokens=4096, max_batch=8, context_page_rows=pr, max_requests=8)
    paged, contiguous = mk(page_rows, "graphs"), mk(512, "graphs")
    random.Random(0).shuffle(paged.fast.pool._free)
    want, want_kv = run(contiguous)
    for got, kv in (run(paged), run(paged, batch=False), run(mk(page_rows, "eager"))):
        assert got == want
        for (k1, v1), (k2, v2) in zip(kv, want_kv):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
