"""KV storage: a per-request cache with explicit capacity and accepted-path compaction; a
device-wide pool that hands out contiguous row ranges; and the paged pool of the target's KV
and the drafter's context (issue 14, plans/0009 §3): fixed pages of ``PAGE_ROWS`` rows, a free list and
a page table per request, so admission counts free pages and never meets fragmentation. Both
pools are one K and one V tensor, so CUDA graphs see fixed addresses.

The target's CPU path (fast="off") keeps one stand-alone ``KVCache`` per request: paging matters
for the device-wide pool of the GPU fast path only.
"""
from __future__ import annotations

import numpy as np
import torch

PAGE_ROWS = 128  # rows per page of the paged pool (= the tree-attention kernel's key block)


class KVCache:
    """K/V rows of one request for every layer.

    ``k``/``v``: [layers, capacity, kv_heads, head_dim]. Rows [0, length) are committed; a
    forward writes its new rows at [length, length + T) without committing them. ``base`` is
    the row of position 0 inside the owning ``KVPool`` (0 for a stand-alone cache).
    """

    def __init__(self, layers: int, capacity: int, kv_heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype):
        shape = (layers, capacity, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.length = 0
        self.base = 0

    @classmethod
    def view(cls, k: torch.Tensor, v: torch.Tensor, base: int, capacity: int) -> "KVCache":
        """A cache over rows [base, base + capacity) of pool tensors k/v [layers, rows, g, d]."""
        c = cls.__new__(cls)
        c.k, c.v = k[:, base:base + capacity], v[:, base:base + capacity]
        c.capacity, c.length, c.base = capacity, 0, base
        return c

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new rows k/v [T, kv_heads, head_dim] after the committed ones and return the
        visible rows [length + T, kv_heads, head_dim]. Raises ValueError past capacity."""
        end = self.length + k.shape[0]
        if end > self.capacity:
            raise ValueError(f"KV rows {end} exceed capacity {self.capacity}")
        self.k[layer, self.length:end] = k
        self.v[layer, self.length:end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def commit(self, rows: torch.Tensor) -> None:
        """Commit the pending rows whose offsets (relative to ``length``) are ``rows`` [n] int64,
        ascending: they are gathered to [length, length + n) and the rest are dropped."""
        n = int(rows.numel())
        if rows.device.type == "cpu" and torch.equal(rows, torch.arange(n)):  # already in place
            self.length += n  # (autoregressive and chain rounds: the path is the first n rows)
            return
        src = rows.to(self.k.device) + self.length
        dst = slice(self.length, self.length + n)
        self.k[:, dst] = self.k[:, src]  # advanced indexing copies before the write
        self.v[:, dst] = self.v[:, src]
        self.length += n

    def move_rows(self, path: list[int]) -> list[tuple[int, int]]:
        """Absolute pool rows (src, dst) that commit the pending rows at offsets ``path``
        (ascending, relative to ``length``), skipping rows already in place."""
        top = self.base + self.length
        return [(top + r, top + i) for i, r in enumerate(path) if r != i]

    @property
    def rows_held(self) -> int:
        return self.capacity

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class KVPool:
    """One K and one V tensor [layers, rows, kv_heads, head_dim] shared by every request on a
    device (vLLM-style pooling, with one contiguous range per request instead of pages).

    Row 0 is a scratch row: padded rows of a graph replay write there and nobody reads it.
    ``allocate`` is first fit over the free ranges; raises MemoryError when no range fits.
    """

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype):
        shape = (layers, rows + 1, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self._free: list[tuple[int, int]] = [(1, rows)]  # (start, length), sorted by start

    def move(self, moves: torch.Tensor) -> None:
        """A commit inside a forward: ``specdec_kernels.kv_commit.kv_move`` over this pool (moves on its device)."""
        from specdec_kernels.kv_commit import kv_move

        kv_move(self.k, self.v, moves)

    def allocate(self, capacity: int) -> KVCache:
        for i, (start, n) in enumerate(self._free):
            if n >= capacity:
                self._free[i:i + 1] = [(start + capacity, n - capacity)] if n > capacity else []
                return KVCache.view(self.k, self.v, start, capacity)
        raise MemoryError(f"no free range of {capacity} KV rows (largest {self.largest_free})")

    def free(self, cache: KVCache) -> None:
        """Return the cache's rows; adjacent free ranges are merged."""
        ranges = sorted(self._free + [(cache.base, cache.capacity)])
        merged = [ranges[0]]
        for s, n in ranges[1:]:
            ps, pn = merged[-1]
            if ps + pn == s:
                merged[-1] = (ps, pn + n)
            else:
                merged.append((s, n))
        self._free = merged

    @property
    def largest_free(self) -> int:
        return max((n for _, n in self._free), default=0)


class PagedCache:
    """A request's rows in a ``PagedKVPool``: ``pages`` (page ids, in position order; any pool
    pages) hold positions [0, len(pages)·page_rows); position s is pool row
    ``pages[s // page_rows] · page_rows + s % page_rows``. ``capacity`` = the rows the request
    may use (≤ its pages' rows); ``length`` = committed rows, as ``KVCache``. ``base`` is the
    page table (what ``modeling.graphs.TreeRows`` takes as a request's place in the pool)."""

    def __init__(self, pool: "PagedKVPool", pages: list[int], capacity: int):
        self.pool, self.pages, self.capacity, self.length = pool, pages, capacity, 0

    @property
    def base(self) -> list[int]:
        return self.pages

    @property
    def rows_held(self) -> int:
        return len(self.pages) * self.pool.page_rows

    def rows(self, positions) -> np.ndarray:
        """Pool rows [n] int64 of request positions [n] (array-like of ints)."""
        s = np.asarray(positions, dtype=np.int64)
        P = self.pool.page_rows
        return np.asarray(self.pages, dtype=np.int64)[s // P] * P + s % P

    def move_rows(self, path: list[int]) -> list[tuple[int, int]]:
        """Absolute pool rows (src, dst) that commit the pending rows at offsets ``path``
        (ascending, relative to ``length``), skipping rows already in place."""
        keep = [(r, i) for i, r in enumerate(path) if r != i]
        if not keep:
            return []
        src = self.rows([self.length + r for r, _ in keep]).tolist()
        dst = self.rows([self.length + i for _, i in keep]).tolist()
        return list(zip(src, dst))

    def commit(self, rows: torch.Tensor) -> None:
        """``KVCache.commit`` over the pages: the pending rows at offsets ``rows`` [n] int64
        (ascending) are gathered to positions [length, length + n)."""
        path = rows.tolist()
        moves = self.move_rows(path)
        if moves:
            self.pool.copy_rows(*map(list, zip(*moves)))
        self.length += len(path)


class PagedKVPool:
    """A device-wide KV pool in pages (the target's KV; the drafter's context): K and V
    [layers, (pages + 1)·page_rows, kv_heads, head_dim]; page 0 is the scratch page (padded
    rows of a graph replay write its row 0 and read only it), pages 1…``pages`` are handed out
    from a free list, any of them to any request. ``rows`` = the KV rows to hold (rounded up to
    whole pages).

    ``allocate(capacity)`` takes ceil(capacity / page_rows) pages at once (admission reserves a
    request's whole budget, plans/0009 §3 option (a): a running request never waits for a
    page); raises MemoryError when fewer pages are free. ``grow`` adds pages to a cache as it
    grows (the drafter's context). ``free`` returns them.

    latent=True: an MLA latent pool (DeepSeek-V3 / Kimi-K2): ``k`` [layers, rows, head_dim] holds
    one latent row c ‖ k_pe per position shared by all heads (head_dim = C + R, kv_heads ignored)
    and ``v`` is None; the pages, free list and commits are the same."""

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype, page_rows: int = PAGE_ROWS, latent: bool = False):
        self.page_rows = page_rows
        self.pages = -(-rows // page_rows)
        n = (self.pages + 1) * page_rows
        shape = (layers, n, head_dim) if latent else (layers, n, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = None if latent else torch.zeros(shape, device=device, dtype=dtype)
        self._free = list(range(self.pages, 0, -1))  # popped from the end: lowest ids first

    def pages_for(self, capacity: int) -> int:
        return -(-capacity // self.page_rows)

    def copy_rows(self, src: list[int], dst: list[int]) -> None:
        """Pool rows src → dst in every layer (K and V; a latent pool's one tensor): a host-driven
        commit. Rows in both lists are read before any is written."""
        s, d = (torch.tensor(x, dtype=torch.int64, device=self.k.device) for x in (src, dst))
        for t in (self.k, self.v):
            if t is not None:
                t[:, d] = t[:, s]  # advanced indexing copies before the write

    move = KVPool.move  # (k [, v] alike)

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, capacity: int) -> PagedCache:
        need = self.pages_for(capacity)
        if need > len(self._free):
            raise MemoryError(f"{need} KV pages of {self.page_rows} rows needed, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(need)]
        return PagedCache(self, pages, capacity)

    def grow(self, cache: PagedCache, capacity: int) -> list[int]:
        """Append pages to ``cache`` until it holds ``capacity`` rows (its positions keep their
        rows; the drafter's context grows this way, a page at a time); returns the new page
        ids (in position order, maybe none). Raises MemoryError (cache unchanged) when fewer
        pages are free than needed."""
        need = self.pages_for(capacity) - len(cache.pages)
        if need > len(self._free):
            raise MemoryError(f"{need} more KV pages of {self.page_rows} rows needed, {len(self._free)} free")
        new = [self._free.pop() for _ in range(max(need, 0))]
        cache.pages += new
        cache.capacity = max(cache.capacity, capacity)
        return new

    def free(self, cache: PagedCache) -> None:
        """Return the cache's pages to the free list (call once per cache; a forward already
        holding its table may still read them — they are reused only by a later forward)."""
        self._free.extend(reversed(cache.pages))
