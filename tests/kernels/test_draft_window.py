"""The draft context window (issue 9 item 4): with ``window`` W the drafter's block attends only
to the last ≥ W context rows (whole pages, ``modeling.dflash.window_start``). W = 0 is the full
context; W ≥ the context is the full context; with a window the CPU path (torch, the context
sliced) and the paged fast path (the kernel's table offset and positions shifted by the window's
first page; Triton's interpreter on CPU, solo and batched) propose the same trees over rounds
that move the window across pages; the window changes the drafts (greedy decoding with a
windowed shipped drafter: tests/draft_service/test_draft_window_lossless.py).
On a GPU: bf16 windowed graphs == windowed eager fast path."""
import pytest
import torch
from conftest import DEVICE
from test_draft_batch import TINY, solo
from test_fast_draft import CFG, parts

from draft_service.engine import DraftEngine, DraftItem
from modeling.dflash import window_start


def engine(fast, window=0, page_rows=8, cfg=TINY, dtype=torch.float32, device=None, pool=512, **kw):
    device = device or DEVICE  # both paths on the same device: fp32 trees equal there
    return DraftEngine(*parts(dtype, cfg, device), max_tree_budget=64, fast=fast, context_pool_tokens=pool,
                       context_page_rows=page_rows, window=window, **kw)


def schedule(cfg, seed=0, prompt=(45, 30, 52), steps=5):
    """Rounds of DraftItems for three requests: prompts of ``prompt`` rows (a tree, a chain, a
    tree), then 1…block_size new rows a round, so windows start on later pages as they grow."""
    g = torch.Generator().manual_seed(seed)
    w, B = len(cfg.target_layer_ids) * cfg.hidden_size, cfg.block_size
    binds = [dict(mode="tree", budget=12), dict(mode="chain"), dict(mode="tree", budget=30)]
    start, out = [0] * len(prompt), []
    for r in range(steps):
        items = []
        for i, n0 in enumerate(prompt):
            n = n0 if r == 0 else 1 + (3 * r + i) % B
            bonus = int(torch.randint(0, cfg.vocab_size, (1,), generator=g))
            items.append(DraftItem(f"r{i}", torch.randn(n, w, generator=g), start[i], bonus,
                                   **(binds[i] if r == 0 else {})))
            start[i] += n
        out.append(items)
    return out


def drafts(e, batch=True, **kw):
    trees = [e.draft_batch(items) if batch else solo(e, items) for items in schedule(e.cfg, **kw)]
    e.release(["r0", "r1", "r2"])
    assert e.live_requests == 0 and (e.fast is None or e.fast.pool.free_pages == e.fast.pool.pages)
    return trees


def test_window_start():
    assert [window_start(p, 0, 8) for p in (0, 5, 1000)] == [0, 0, 0]  # no window
    assert [window_start(p, 12, 8) for p in (5, 12, 13, 20, 21, 28, 29)] == [0, 0, 0, 8, 8, 16, 16]
    assert all(p - window_start(p, 12, 8) >= 12 for p in range(12, 200))  # at least the window
    assert all(p - window_start(p, 12, 8) < 12 + 8 for p in range(200))  # less than a page more


def test_window_cpu_path_equals_paged_path():
    """W = 12 rows over pages of 8 (two requests, contexts 21…40 rows): the torch path, the paged path solo
    (``meta``) and batched (``row_meta``) draft the same trees every round; they differ from the
    full context's; W ≥ every context gives the full context's trees, W = 0 is the default."""
    kw = dict(prompt=(29, 21), steps=3)
    full = drafts(engine("off"), **kw)
    want = drafts(engine("off", window=12), **kw)
    assert drafts(engine("eager", window=12), **kw) == want
    assert drafts(engine("eager", window=12), batch=False, **kw) == want
    assert want != full and want[0] != full[0]  # the window bites from the first round
    assert drafts(engine("off", window=1000), **kw) == full == drafts(engine("off", window=0), **kw)
    with pytest.raises(ValueError, match="window must be >= 0"):
        engine("off", window=-1)


def test_window_returns_the_pages_before_it():
    """Paged, W = 12, pages of 8, block 4: a 28-row prompt takes 4 pages (32 rows with its
    block), then the 2 wholly before its window (rows 16…) go back to the pool; 10 more rows
    take 2 pages and free 1; release returns the rest, the scratch page never enters the free
    list."""
    e = engine("eager", window=12)
    pool, w = e.fast.pool, e.feature_width
    e.draft("x", torch.randn(28, w), 0, 1, "chain")
    assert pool.pages - pool.free_pages == 2 and e.fast.ctx["x"].pages[:3] == [0, 0, 3]
    e.draft("x", torch.randn(10, w), 28, 2)  # p = 38: window from row 24 (page 3), pages for 42 rows
    assert pool.pages - pool.free_pages == 3 and e.fast.ctx["x"].pages[:4] == [0, 0, 0, 4]
    e.release(["x"])
    assert pool.free_pages == pool.pages and 0 not in pool._free


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("page_rows", [16, 128])
def test_windowed_graphs_equal_windowed_eager_bf16(page_rows):
    """bf16, the default test drafter shape: W = 40 with pages of 16 / W = 100 with pages of 128
    (prompts 150…300 rows; with 128-row pages one request's window starts past row 0 from its
    prompt on, one from a later round, one never), solo and batch graphs == the eager fast
    path, and both differ from the full context."""
    W = 40 if page_rows == 16 else 100
    mk = lambda fast, window: engine(fast, window, page_rows, CFG, torch.bfloat16, "cuda", 4096, max_batch=8)
    kw = dict(prompt=(150, 300, 220), steps=6)
    want = drafts(mk("eager", W), **kw)
    assert drafts(mk("graphs", W), **kw) == want
    assert drafts(mk("graphs", W), batch=False, **kw) == want
    assert drafts(mk("graphs", 0), **kw) != want
