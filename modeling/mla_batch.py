"""Several requests' rows in one row-invariant DeepSeek-V3 / Kimi-K2 forward over a paged MLA
latent pool (plans/0010-deepseek-graphs.md, step 3, eager): the object ``DeepseekModel.forward``
takes as both its cache and its attention.

Each request brings its ``PagedCache`` (committed rows [0, L)) and a tree — a chain for a prefill
piece — of n rows, which take the request's logical rows L … L + n − 1 (tree node j at L + j) in its
pages, uncommitted; a node at depth δ is at position L + δ and sees the request's committed rows
and its root path. The latent rows are written through one device index of pool rows; attention is
``kernels.mla_attention`` with the requests' page tables, so a request's logits are bitwise those of
its solo forward (the kernels are row-invariant) whatever else shares the forward. Commit with
``PagedCache.commit`` as for the Llama target.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from modeling.kv_cache import PagedCache, PagedKVPool


@dataclass
class MLATree:
    """One request's rows: tokens [n]; depths [n] and ancestors [n, w] (``modeling.tree.tree_ancestors``;
    a chain for a prefill piece); its cache in the latent pool (L = cache.length)."""
    tokens: list[int]
    depths: np.ndarray
    ancestors: np.ndarray
    cache: PagedCache


class MLABatch:
    """Inputs of one forward over ``pool`` (a ``PagedKVPool(latent=True)``) for ``trees``, built on
    the host and copied once. ``tokens``, ``positions`` [R] int64 (R = Σ n), ``kv`` the pool's latent
    tensor [layers, rows, C + R]; ``write`` / ``__call__`` as ``MLACache.write`` / ``KernelAttention``.
    Raises ValueError when a tree does not fit its cache's capacity."""

    def __init__(self, pool: PagedKVPool, trees: Sequence[MLATree], device):
        if pool.v is not None:
            raise ValueError("MLABatch needs a latent pool (PagedKVPool(latent=True))")
        self.pool, self.kv = pool, pool.k
        W = max(t.ancestors.shape[1] for t in trees)
        tokens, pos, anc, slots, tables, self.seqs, r0 = [], [], [], [], [], [], 0
        for t in trees:
            n, L = len(t.tokens), t.cache.length
            if L + n > t.cache.capacity:
                raise ValueError(f"rows {L + n} exceed the request's capacity {t.cache.capacity}")
            tokens += t.tokens
            pos.append(L + np.asarray(t.depths, dtype=np.int64))
            anc.append(np.pad(np.asarray(t.ancestors, dtype=np.int64), ((0, 0), (0, W - t.ancestors.shape[1]))))
            slots.append(t.cache.rows(np.arange(L, L + n)))
            self.seqs.append((r0, n, sum(len(x) for x in tables), L))
            tables.append(t.cache.pages)
            r0 += n
        as_t = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt).to(device)  # noqa: E731
        self.tokens = as_t(tokens, torch.int64)
        pos = np.concatenate(pos)
        self.positions = as_t(pos, torch.int64)
        self.ancestors = as_t(np.concatenate(anc), torch.int32)
        self.slots = as_t(np.concatenate(slots), torch.int64)
        self.pages = as_t(np.concatenate([np.asarray(x, dtype=np.int64) for x in tables]), torch.int32)
        self.max_positions = int(pos.max()) + 1 if len(pos) else 1  # (host values: no device sync)
        self._tiles: dict[int, torch.Tensor] = {}

    def write(self, layer: int, latent: torch.Tensor) -> None:
        """latent [R, C + R'] → the rows' pool rows of ``layer`` (uncommitted)."""
        self.kv[layer].index_copy_(0, self.slots, latent.to(self.kv.dtype))

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, scale: float, C: int) -> torch.Tensor:
        """Absorbed MLA attention of q [R, h, C + R'] over the pool's layer ``kv``; [R, h, C]."""
        from kernels.mla_attention import default_block_r, make_tiles, mla_attention

        h = q.shape[1]
        if h not in self._tiles:
            self._tiles[h] = make_tiles(self.seqs, default_block_r(h), q.device)
        return mla_attention(q, kv, self.positions, self.ancestors, self.seqs, scale, C,
                             max_positions=self.max_positions, tiles=self._tiles[h], pages=self.pages,
                             page_rows=self.pool.page_rows)
