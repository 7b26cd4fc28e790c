"""Several requests' rows in one row-invariant DeepSeek-V3 / Kimi-K2 forward over a paged MLA
latent pool (plans/0010-deepseek-graphs.md, step 3, eager): the object ``DeepseekModel.forward``
takes as both its cache and its attention.

Each request brings its ``PagedCache`` (committed rows [0, L)) and a tree — a chain for a prefill
piece — of n rows, which take the request's logical rows L … L + n − 1 (tree node j at L + j) in its
pages, uncommitted; a node at depth δ is at position L + δ and sees the request's committed rows
and its root path. The latent rows are written through one device index of pool rows; attention is
``specdec_kernels.mla_attention`` with the requests' page tables, so a request's logits are bitwise those of
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


class PagedMLARows:
    """Device inputs of one forward over a paged latent pool, as both the model's cache and its
    attention: ``kv`` (the pool's latent tensor [layers, rows, C + R]), the rows' pool ``slots`` [R],
    ``positions`` [R], ``ancestors`` [R, W] (tree-local rows), the page tables ``pages``; either
    ``seqs`` (host tuples) or the device ``row_meta`` [R, 2] (table offset, L per row; the tile
    table is then built on the device) with ``max_tree_rows``; ``max_positions`` bounds the
    positions (sizes the kernel's chunk grid)."""

    def __init__(self, pool: PagedKVPool, slots, positions, ancestors, pages, max_positions: int,
                 seqs=None, row_meta=None, max_tree_rows: int | None = None):
        if pool.v is not None:
            raise ValueError("a latent pool is needed (PagedKVPool(latent=True))")
        self.pool, self.kv, self.slots, self.positions, self.ancestors = pool, pool.k, slots, positions, ancestors
        self.pages, self.max_positions, self.seqs, self.max_tree_rows = pages, max_positions, seqs, max_tree_rows
        self.row_meta = row_meta
        self._tiles: dict[int, torch.Tensor] = {}  # per head count (block_r follows it)

    def write(self, layer: int, latent: torch.Tensor) -> None:
        """latent [R, C + R'] → the rows' pool rows of ``layer`` (uncommitted)."""
        self.kv[layer].index_copy_(0, self.slots, latent.to(self.kv.dtype))

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, scale: float, C: int) -> torch.Tensor:
        """Absorbed MLA attention of q [R, h, C + R'] over the pool's layer ``kv``; [R, h, C]."""
        from specdec_kernels.mla_attention import default_block_r, make_tiles, mla_attention, tiles_from_rows

        h = q.shape[1]
        if h not in self._tiles:
            self._tiles[h] = (make_tiles(self.seqs, default_block_r(h), q.device) if self.row_meta is None
                              else tiles_from_rows(self.row_meta, default_block_r(h)))
        return mla_attention(q, kv, self.positions, self.ancestors, self.seqs, scale, C,
                             max_positions=self.max_positions, tiles=self._tiles[h], pages=self.pages,
                             page_rows=self.pool.page_rows, max_tree_rows=self.max_tree_rows)


class MLABatch(PagedMLARows):
    """The inputs of one forward for ``trees`` over ``pool`` (a ``PagedKVPool(latent=True)``), built
    on the host and copied once; ``tokens`` [R] int64 besides ``PagedMLARows``'. Raises ValueError
    when a tree does not fit its cache's capacity."""

    def __init__(self, pool: PagedKVPool, trees: Sequence[MLATree], device):
        W = max(t.ancestors.shape[1] for t in trees)
        tokens, pos, anc, slots, tables, seqs, r0 = [], [], [], [], [], [], 0
        for t in trees:
            n, L = len(t.tokens), t.cache.length
            if L + n > t.cache.capacity:
                raise ValueError(f"rows {L + n} exceed the request's capacity {t.cache.capacity}")
            tokens += t.tokens
            pos.append(L + np.asarray(t.depths, dtype=np.int64))
            anc.append(np.pad(np.asarray(t.ancestors, dtype=np.int64), ((0, 0), (0, W - t.ancestors.shape[1]))))
            slots.append(t.cache.rows(np.arange(L, L + n)))
            seqs.append((r0, n, sum(len(x) for x in tables), L))
            tables.append(t.cache.pages)
            r0 += n
        as_t = lambda a, dt: torch.as_tensor(np.asarray(a), dtype=dt).to(device)  # noqa: E731
        pos = np.concatenate(pos)
        self.tokens = as_t(tokens, torch.int64)
        super().__init__(pool, as_t(np.concatenate(slots), torch.int64), as_t(pos, torch.int64),
                         as_t(np.concatenate(anc), torch.int32),
                         as_t(np.concatenate([np.asarray(x, dtype=np.int64) for x in tables]), torch.int32),
                         int(pos.max()) + 1 if len(pos) else 1, seqs=seqs)  # (host values: no device sync)


class RowInvariantDeepseek:
    """The GPU fast path's verify forward for a DeepSeek-V3 / Kimi-K2 target (plans/0010), with
    ``modeling.fast_forward.RowInvariantLlama``'s call so ``modeling.graphs`` runs it unchanged:
    device inputs only (``modeling.graphs.TreeInputs`` views), no host sync — a CUDA graph can
    capture it. ``model``: a ``DeepseekModel`` switched by ``row_invariant_``; ``pool``: its
    ``PagedKVPool(latent=True)``; taps: ascending decoder layers whose outputs are the features;
    max_positions: a bound of any row's position + 1 (the request context limit: sizes the MLA
    kernel's chunk grid, fixed for a graph; default the pool's rows)."""

    def __init__(self, model, pool: PagedKVPool, taps: tuple[int, ...], max_positions: int | None = None):
        self.model, self.pool, self.taps, self.cfg = model, pool, tuple(taps), model.cfg
        self.max_positions = min(max_positions or pool.k.shape[1], pool.k.shape[1])
        self.embed = model.model.embed_tokens.weight

    def __call__(self, tokens, positions, slots, ancestors, meta, row_meta=None, pages=None):
        """As ``RowInvariantLlama.__call__`` over a paged pool (row_meta and pages given): tokens,
        positions, slots [R]; ancestors flat with row stride meta[2]; row_meta [R, 2] = (table offset,
        L) per row; pages the packed page tables. Returns (logits [R, V] float32, features or None)."""
        R = tokens.shape[0]
        j = torch.arange(R, device=tokens.device)
        flat = ancestors[:R * R]  # the rows' ancestor lists, row stride W (a device value): as [R, R]
        anc = flat[(j[:, None] * meta[2] + j[None, :]).clamp_(max=flat.numel() - 1)]
        rows = PagedMLARows(self.pool, slots, positions, anc, pages, self.max_positions, row_meta=row_meta,
                            max_tree_rows=R)
        hidden, feats = self.model(tokens, positions, rows, rows, self.taps)
        return self.model.logits(hidden), feats
