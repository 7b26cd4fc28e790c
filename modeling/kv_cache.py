"""Per-request KV cache with explicit capacity and accepted-path compaction."""
from __future__ import annotations

import torch


class KVCache:
    """K/V rows of one request for every layer.

    ``k``/``v``: [layers, capacity, kv_heads, head_dim]. Rows [0, length) are committed; a
    forward writes its new rows at [length, length + T) without committing them.
    """

    def __init__(self, layers: int, capacity: int, kv_heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype):
        shape = (layers, capacity, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.capacity = capacity
        self.length = 0

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
        src = rows.to(self.k.device) + self.length
        dst = slice(self.length, self.length + n)
        self.k[:, dst] = self.k[:, src]  # advanced indexing copies before the write
        self.v[:, dst] = self.v[:, src]
        self.length += n

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
