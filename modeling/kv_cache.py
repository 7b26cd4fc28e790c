"""KV storage: a per-request cache with explicit capacity and accepted-path compaction, and a
device-wide pool that hands out contiguous row ranges (so CUDA graphs see fixed addresses)."""
from __future__ import annotations

import torch


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
