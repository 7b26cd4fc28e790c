"""Verify forward entry points for the GPU: inputs built on the host and sent in one copy,
then the row-invariant forward run eagerly or replayed from CUDA graphs, one per row bucket
(nano-vllm's scheme, shifted by the root row: buckets 1, 2, 3, 5, 9, then every 16 from 17 up
to the largest tree; captured largest first into one memory pool; padded rows made harmless
before every replay). A greedy verify's result (samples, accepted path, its features) comes
back in one copy, and the previous tree's commit runs inside the forward (``specdec_kernels.kv_commit``).

A forward may hold the trees of several requests (a batched verify, issue 14): their rows are
concatenated, each row carries its request's (base, L) (``specdec_kernels.tree_attention``'s
``row_meta``), ancestors are padded to the widest tree, and every request's commit moves run
in the same launch (one group of moves per request). The kernels are row-invariant, so a
request's logits are bitwise those of its solo forward whatever else shares the launch.

Padded rows (bucket − n of them) take token 0 at position 0 of (base 0, L 0) with themselves
as their only ancestor: they read and write only the pool's scratch row 0, so nothing of an
earlier, larger batch can reach a real row.

Over a paged pool (``modeling.kv_cache.PagedKVPool``, the target engine's; issue 14) the
forward's trees' page tables are packed into the input buffer too: a row's base is its tree's
table offset there, write rows (slots) and KV-move rows are computed on the host from the
tables, and padded rows point at a table entry of the scratch page 0. Over a contiguous
``KVPool`` a base is the request's first pool row.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from specdec_kernels.kv_commit import MAX_MOVES
from modeling.fast_forward import RowInvariantLlama
from modeling.kv_cache import PagedKVPool
from modeling.sampling import (SamplingParams, inverse_cdf, position_uniforms, processed_logprobs_device,
                               sample_tree_device, sampling_words)

PATH_MAX = MAX_MOVES  # accepted-path rows whose features the greedy tail gathers on the device


def buckets_for(max_rows: int) -> list[int]:
    """Row buckets covering 1…max_rows: 1, 2, 3, 5, 9, then every 16 from 17, so a tree of a
    power-of-two budget (root + 2^k nodes) fills its bucket without padded rows."""
    small = [b for b in (1, 2, 3, 5, 9) if b < max_rows]
    return small + list(range(17, max_rows + 16, 16)) if max_rows > 9 else small + [max_rows]


@dataclass
class TreeRows:
    """One request's tree in a verify forward (host values): tokens [n]; depths [n] and
    ancestors [n, w] from ``modeling.tree.tree_ancestors``; the request's place in the pool
    (``base``: its row of position 0 in a contiguous ``KVPool``, its page table — a list of
    page ids — in a ``PagedKVPool``) and committed length ``L``; its sampling words (``modeling.sampling.
    sampling_words``; sampled requests only); the KV moves of its previous tree's commit
    (absolute (src, dst) pool rows, ≤ MAX_MOVES)."""
    tokens: list[int]
    depths: np.ndarray
    ancestors: np.ndarray
    base: int | Sequence[int]
    L: int
    words: list[int] | None = None
    moves: Sequence[tuple[int, int]] = ()


class TreeInputs:
    """One int64 buffer on the device holding a verify's inputs, filled from a pinned host
    mirror with a single copy. Layout (R = max rows, B = max trees per forward,
    C = ``specdec_kernels.kv_commit.MAX_MOVES``): tokens [0, R), positions [R, 2R), slots [2R, 3R),
    row meta (base, L) per row [3R, 5R), meta (base, L, W) of the first tree [5R, 5R+3),
    per tree: meta (base, L, W) [B, 3], sampling words [B, 4] (sampled requests only), KV moves
    of its previous tree's commit (src rows | dst rows) [B, 2C]; then ancestors flat with row
    stride W (the widest tree's depth + 1); then, over a paged pool (``page_rows`` > 0), the
    trees' page tables packed one after another ([table] entries: at most the pool's pages, as
    the trees are distinct requests' — a batch-of-one prefill chunk included — plus the
    padded rows' entry 0). With pages, a row's and a tree's base is its tree's table offset and
    meta's base is 0."""

    def __init__(self, max_rows: int, device: torch.device, max_trees: int = 1, table: int = 0,
                 page_rows: int = 0):
        R, B = self.R, self.B = max_rows, max_trees
        self.page_rows = page_rows
        self.m = 5 * R + 3          # per-tree meta offset
        self.w = self.m + 3 * B     # words offset
        self.mv = self.w + 4 * B    # moves offset
        self.a = self.mv + 2 * MAX_MOVES * B  # ancestors offset
        self.t = self.a + R * R     # page tables offset
        size = self.t + table
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.host_t = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host = self.host_t.numpy()
        self.W = 1
        self._moved = 0  # move groups written by the last load (zeroed by the next)
        # the last load's host → device copy: the pinned host buffer may be rewritten only once
        # the device has read it (a prefill chunk returns without a sync, so the next load can
        # come while its copy still waits in the stream)
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def views(self, rows: int) -> tuple[torch.Tensor, ...]:
        """(tokens, positions, slots, ancestors, meta, row_meta [rows, 2]) device views for a
        forward of ``rows``."""
        R, d = self.R, self.dev
        return (d[:rows], d[R:R + rows], d[2 * R:2 * R + rows], d[self.a:], d[5 * R:5 * R + 3],
                d[3 * R:3 * R + 2 * rows].view(rows, 2))

    @property
    def pages(self) -> torch.Tensor | None:
        """The page-table region (paged pool), else None."""
        return self.dev[self.t:] if self.page_rows else None

    @property
    def words(self) -> torch.Tensor:
        """The first tree's sampling words [4] (what the batch-of-one tails read)."""
        return self.dev[self.w:self.w + 4]

    def tree_meta(self, k: int) -> torch.Tensor:
        return self.dev[self.m + 3 * k:self.m + 3 * k + 3]

    def tree_words(self, k: int) -> torch.Tensor:
        return self.dev[self.w + 4 * k:self.w + 4 * k + 4]

    @property
    def moves(self) -> torch.Tensor:
        return self.dev[self.mv:self.a]

    def load(self, tokens: list[int], depths: np.ndarray, ancestors: np.ndarray, base: int, L: int,
             rows: int, words: list[int] | None = None, moves: Sequence[tuple[int, int]] = ()) -> None:
        """One tree: ``load_trees([TreeRows(...)], rows)``."""
        self.load_trees([TreeRows(tokens, depths, ancestors, base, L, words, moves)], rows)

    def load_trees(self, trees: Sequence[TreeRows], rows: int) -> list[tuple[int, int]]:
        """Fill rows [0, n) with the trees, one after another (n = their total rows ≤ rows ≤ R,
        ≤ B trees), and rows [n, rows) as padding; the KV moves (groups of trees without moves
        all zero, so a stale move never repeats); copy to the device. Returns each tree's
        (first row, end row)."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous load's copy has read the host buffer
        R, h, a = self.R, self.host, self.a
        k = len(trees)
        assert 0 < k <= self.B, f"{k} trees in a forward of at most {self.B}"
        W = self.W = max(t.ancestors.shape[1] for t in trees)
        rm = h[3 * R:5 * R].reshape(R, 2)
        P, used = self.page_rows, 0
        if P:  # page tables packed from self.t; bases = table offsets
            bases = []
            for t in trees:
                bases.append(used)
                h[self.t + used:self.t + used + len(t.base)] = t.base
                used += len(t.base)
            h[self.t + used] = 0  # the padded rows' table: the scratch page
        else:
            bases = [t.base for t in trees]
        if k == 1:  # batch of one: no concatenation
            t = trees[0]
            n = len(t.tokens)
            spans = [(0, n)]
            h[:n] = t.tokens
            h[R:R + n] = t.L + t.depths
            h[2 * R:2 * R + n] = self._rows(t, t.L, n)
            rm[:n, 0], rm[:n, 1] = bases[0], t.L
            anc = h[a:a + rows * W].reshape(rows, W)
            anc[:n, :t.ancestors.shape[1]] = t.ancestors
            anc[:n, t.ancestors.shape[1]:] = 0
        else:
            sizes = np.array([len(t.tokens) for t in trees])
            ends = np.cumsum(sizes)
            starts = ends - sizes
            n = int(ends[-1])
            spans = list(zip(starts.tolist(), ends.tolist()))
            base = np.repeat(bases, sizes)
            L = np.repeat([t.L for t in trees], sizes)
            h[:n] = [x for t in trees for x in t.tokens]
            h[R:R + n] = L + np.concatenate([t.depths for t in trees])
            if P:
                h[2 * R:2 * R + n] = np.concatenate([self._rows(t, t.L, len(t.tokens)) for t in trees])
            else:
                h[2 * R:2 * R + n] = base + L + np.arange(n) - np.repeat(starts, sizes)
            rm[:n, 0], rm[:n, 1] = base, L
            anc = h[a:a + rows * W].reshape(rows, W)
            anc[:n] = 0
            for (r0, r1), t in zip(spans, trees):
                anc[r0:r1, :t.ancestors.shape[1]] = t.ancestors
        assert n <= rows <= R, f"{n} rows in a forward of {rows} (max {R})"
        h[n:rows] = 0                      # padded rows: token 0 at position 0 of (base 0, L 0),
        h[R + n:R + rows] = 0              # their own root as the only ancestor, K/V written to
        h[2 * R + n:2 * R + rows] = 0      # the scratch row
        rm[n:rows, 0], rm[n:rows, 1] = used, 0  # (paged: the scratch page's entry)
        anc[n:] = 0
        h[5 * R:5 * R + 3] = (0 if P else bases[0], trees[0].L, W)
        meta = h[self.m:self.m + 3 * k].reshape(k, 3)
        meta[:, 0], meta[:, 1], meta[:, 2] = bases, [t.L for t in trees], W
        moves = h[self.mv:self.a].reshape(self.B, 2, MAX_MOVES)
        moves[:self._moved] = 0  # the groups the last load wrote
        self._moved = 0
        for j, t in enumerate(trees):
            if t.words is not None:
                h[self.w + 4 * j:self.w + 4 * j + 4] = t.words
            if t.moves:
                src, dst = zip(*t.moves)
                moves[j, 0, :len(src)], moves[j, 1, :len(dst)] = src, dst
                self._moved = j + 1
        end = a + rows * W
        self.dev[:end].copy_(self.host_t[:end], non_blocking=True)
        if P:
            self.dev[self.t:self.t + used + 1].copy_(self.host_t[self.t:self.t + used + 1], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return spans

    def _rows(self, t: TreeRows, start: int, n: int) -> np.ndarray:
        """Pool rows of tree t's positions [start, start + n)."""
        s = np.arange(start, start + n)
        if not self.page_rows:
            return t.base + s
        P = self.page_rows
        return np.asarray(t.base, dtype=np.int64)[s // P] * P + s % P


def path_tail(samples: torch.Tensor, feats: torch.Tensor | None, tokens: torch.Tensor, positions: torch.Tensor,
              ancestors: torch.Tensor, meta: torch.Tensor, out_ints: torch.Tensor,
              out_feats: torch.Tensor | None) -> None:
    """A verify's result on the device, no host read (graph-capturable): given one target sample
    per row, the deepest node whose root path matches the samples (sample-and-match; DOMAIN §4),
    if that path has ≤ PATH_MAX rows, and the features of that path's rows.

    samples [R] int64; feats [R, F] or None; tokens, positions [R] int64 (position = L + depth;
    padded rows sit at depth 0); ancestors flat int64 with row stride meta[2]; meta (base, L, W).
    Writes out_ints [2 + R'] int64 = (end node, its depth, samples[0:R]) and out_feats
    [PATH_MAX, F] = features of the end node's root path (rows beyond its depth unspecified).
    """
    R = samples.shape[0]
    dev = samples.device
    depth = positions - meta[1]
    W = meta[2]
    row = torch.arange(R, device=dev)
    j = torch.arange(PATH_MAX, device=dev)
    valid = (j[None, :] <= depth[:, None]) & (j[None, :] < W)
    path = ancestors[torch.where(valid, row[:, None] * W + j[None, :], 0)]  # [R, P]: root path nodes
    parent = ancestors[row * W + (depth - 1).clamp(min=0)]
    match = (tokens == samples[parent]) | (depth == 0)
    ok = (match[path] | ~valid).all(-1) & (depth < PATH_MAX)
    end = torch.where(ok, depth, -1).argmax().view(1)  # first deepest: the root when nothing matches
    out_ints[0:1] = end
    out_ints[1:2] = depth.index_select(0, end)
    out_ints[2:2 + R] = samples
    if out_feats is not None and feats is not None:
        torch.index_select(feats, 0, path.index_select(0, end)[0], out=out_feats)


def sample_trees_device(logits: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor,
                        words: torch.Tensor, filtered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``modeling.sampling.sample_tree_device`` for the rows of several trees with their own
    sampling words, in one set of launches: logits [S, V]; tokens, positions [S] int64;
    parents [S] int64 = the index (among these S rows) of each row's parent (a root: any row);
    words [S, 4] int64 per row (``sampling_words`` of its request). Each row is drawn exactly as
    ``sample_tree_device`` draws it alone (per-row parameters broadcast through
    ``processed_logprobs_device``; every operation is per row). Returns (samples [S] int64,
    edge probabilities [S] float64; a root's edge is meaningless)."""
    f64 = words.view(torch.float64)
    lp = processed_logprobs_device(logits, f64[:, 0:1], words[:, 1:2], f64[:, 2:3], filtered)
    V = lp.shape[1]
    edge = lp.view(-1)[parents * V + tokens].exp()
    u = position_uniforms(words[:, 3], positions + 1)
    return inverse_cdf(lp, u[:, None])[:, 0], edge


class _Verify:
    """Shared by the eager and the graphed verify: the input buffer and a result buffer on the
    device with a pinned host mirror, so a round's result comes back in one copy. Result layout
    (R = max rows): int64 (end node, end depth, samples [R]), float64 edge probabilities [R]
    (sampled rounds), then the end node's root-path features [PATH_MAX, F] in the model dtype.

    A call runs one forward over one tree (``__call__``) or several requests' trees
    (``batch``); after a forward of one tree, ``greedy()`` / ``sampled()`` return its result in
    one copy back (the path walked on the device); after any forward, ``batch_samples()`` and
    ``path_features()`` return every tree's samples / edge probabilities (one copy back) and the
    features of host-walked paths (one gather, one copy back)."""

    def __init__(self, forward: RowInvariantLlama, max_rows: int, device: torch.device, max_trees: int = 1):
        pool = forward.pool
        paged = isinstance(pool, PagedKVPool)
        self.forward = forward
        self.inputs = TreeInputs(max_rows, device, max_trees, pool.pages + 1 if paged else 0,
                                 pool.page_rows if paged else 0)
        R = self.inputs.R
        width = len(forward.taps) * forward.cfg.hidden_size
        dt = forward.embed.dtype
        self.ints_end, self.edges_end = 8 * (2 + R), 8 * (2 + 2 * R)
        size = self.edges_end + (PATH_MAX * width * forward.embed.element_size() if width else 0)
        self.out = torch.zeros(size, dtype=torch.uint8, device=device)
        self.out_host = torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
        views = lambda b: (b[:self.ints_end].view(torch.int64), b[self.ints_end:self.edges_end].view(torch.float64),
                           b[self.edges_end:].view(dt).view(PATH_MAX, width) if width else None)
        self.out_ints, self.out_edges, self.out_feats = views(self.out)
        self.host_ints, self.host_edges, self.host_feats = views(self.out_host)

    @property
    def max_trees(self) -> int:
        return self.inputs.B

    def _step(self, rows: int):
        """KV moves of the commits, then the forward over the first ``rows`` input rows."""
        self.forward.pool.move(self.inputs.moves)  # (a tensor-parallel pool mirrors it on every rank)
        return self.forward(*self.inputs.views(rows), pages=self.inputs.pages)

    def _run(self, trees: Sequence[TreeRows]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Load the trees and run the forward; sets ``n``, ``spans``, ``logits``, ``feats``."""
        raise NotImplementedError

    @torch.inference_mode()
    def __call__(self, tokens, depths, ancestors, base, L, words=None, moves=()):
        """One tree (host values, see ``TreeRows``); returns (logits [n, V] float32, features
        [n, taps·H] or None), views valid until the next call."""
        return self._run([TreeRows(tokens, depths, ancestors, base, L, words, moves)])

    @torch.inference_mode()
    def batch(self, trees: Sequence[TreeRows]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Several requests' trees in one forward (≤ ``max_trees`` trees, ≤ the max rows in
        all); returns (logits [N, V], features [N, F] or None) over their concatenated rows
        (``spans`` gives each tree's rows)."""
        return self._run(trees)

    def _greedy_tail(self, rows: int, logits, feats) -> None:
        tokens, positions, _, ancestors, meta, _ = self.inputs.views(rows)
        path_tail(logits.argmax(-1), feats, tokens, positions, ancestors, meta, self.out_ints, self.out_feats)

    def _sample_tail(self, rows: int, logits, feats, filtered: bool) -> torch.Tensor:
        """Sample the tree (``sample_tree_device``), then the path and its features; returns
        the [2, rows] float64 draws (samples, edge probabilities)."""
        tokens, positions, _, ancestors, meta, _ = self.inputs.views(rows)
        drawn = sample_tree_device(logits, tokens, positions, ancestors, meta, self.inputs.words, filtered)
        path_tail(drawn[0].long(), feats, tokens, positions, ancestors, meta, self.out_ints, self.out_feats)
        self.out_edges[:rows].copy_(drawn[1])
        return drawn

    def _fetch(self, features: bool, edges: bool) -> tuple:
        """(samples [n], edge probabilities [n] or None, end node, end depth, pinned
        [PATH_MAX, F] features of the end's root path or None); the features view is
        overwritten by the next round."""
        n, feats = self.n, features and self.out_feats is not None
        end = len(self.out) if feats else (self.ints_end + 8 * n if edges else 8 * (2 + n))
        self._copy_back(end)
        ints = self.host_ints[:2 + n].tolist()
        edge = self.host_edges[:n].tolist() if edges else None
        return ints[2:], edge, ints[0], ints[1], (self.host_feats if feats else None)

    def _copy_back(self, end: int) -> None:
        self.out_host[:end].copy_(self.out[:end], non_blocking=True)
        if self.out.device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    @torch.inference_mode()
    def batch_samples(self, sampled: dict[int, bool]) -> tuple[list[int], list[float] | None]:
        """After a forward: every row's sample and edge probability, one copy back. Rows of
        greedy trees take the argmax (their edge entries are meaningless); the rows of the
        trees listed in ``sampled`` (tree index → filtered, see ``modeling.sampling.filtered``)
        are drawn with their own words, all in one ``sample_trees_device`` (eager, ~30
        launches whatever the number of sampled trees; filtered if any tree is, which is
        bitwise the unfiltered law for the others). Returns (samples [N], edge probabilities
        [N] or None when no tree is sampled)."""
        n, logits = self.n, self.logits
        tokens, positions, _, ancestors, _, row_meta = self.inputs.views(n)
        ints = self.out_ints[2:2 + n]
        torch.argmax(logits, -1, out=ints)
        if sampled:
            spans = [self.spans[k] for k in sampled]
            sizes = [r1 - r0 for r0, r1 in spans]
            starts = np.cumsum([0] + sizes[:-1])
            host = np.stack([np.concatenate([np.arange(r0, r1) for r0, r1 in spans]),  # rows
                             np.repeat(list(sampled), sizes),                            # their tree
                             np.repeat(starts, sizes)])                                  # its first pick
            rows, tree, first = torch.from_numpy(host).to(logits.device, non_blocking=True)
            W = self.inputs.W
            words = self.inputs.dev[self.inputs.w:self.inputs.w + 4 * self.inputs.B].view(-1, 4)[tree]
            pos = positions[rows]
            depth = pos - row_meta[rows, 1]
            parents = first + ancestors[rows * W + (depth - 1).clamp(min=0)]
            drawn, edge = sample_trees_device(logits.index_select(0, rows), tokens[rows], pos, parents, words,
                                              any(sampled.values()))
            ints.index_copy_(0, rows, drawn)
            self.out_edges.index_copy_(0, rows, edge)
        self._copy_back(self.ints_end + 8 * n if sampled else 8 * (2 + n))
        return self.host_ints[2:2 + n].tolist(), (self.host_edges[:n].tolist() if sampled else None)

    @torch.inference_mode()
    def path_features(self, rows: list[int]) -> torch.Tensor:
        """Features [len(rows), F] (a new CPU tensor) of the last forward's rows (indices into
        its concatenated rows): one gather on the device, one copy back."""
        idx = torch.tensor(rows, dtype=torch.int64).to(self.feats.device, non_blocking=True)
        return self.feats.index_select(0, idx).cpu()


class EagerVerify(_Verify):
    """The row-invariant forward without graphs (``--no-graphs``). Call with (tokens, depths,
    ancestors, base, L[, words[, moves]]) host values, or ``batch(trees)``; returns (logits
    [n, V] float32, features [n, taps·H]). ``sample()`` then returns the last tree's [2, n]
    float64 samples and edge probabilities (``modeling.sampling.sample_tree_device`` with the
    words given); ``greedy()`` and ``sampled()`` the samples (and edge probabilities), the
    matching path's end node and depth and its features (``path_tail``) in one copy back."""

    def _run(self, trees):
        self.spans = self.inputs.load_trees(trees, sum(len(t.tokens) for t in trees))
        self.n = n = self.spans[-1][1]
        self.logits, self.feats = self._step(n)
        return self.logits, self.feats

    @torch.inference_mode()
    def sample(self, filtered: bool = True) -> torch.Tensor:
        return self._sample_tail(self.n, self.logits, self.feats, filtered)

    @torch.inference_mode()
    def greedy(self, features: bool = True) -> tuple:
        """Argmax samples, the matching path and its features, in one copy back (see ``_fetch``)."""
        self._greedy_tail(self.n, self.logits, self.feats)
        return self._fetch(features, False)

    @torch.inference_mode()
    def sampled(self, filtered: bool = True, features: bool = True) -> tuple:
        """Samples, edge probabilities, the matching path and its features (``_fetch``)."""
        self._sample_tail(self.n, self.logits, self.feats, filtered)
        return self._fetch(features, True)


class VerifyGraphs(_Verify):
    """Captured ``RowInvariantLlama`` forwards (each preceded by the commits' KV moves), one per
    bucket of total rows, and per bucket three graphs reading that forward's outputs: the
    greedy tail and the tree samplers of sampled requests (with and without top-k/top-p
    filtering), each ending in ``path_tail`` (used for a forward of one tree). ``max_rows`` =
    the most rows of one forward (at least root + max tree nodes); ``max_trees`` = the most
    trees (requests) of one forward. A call (same arguments as ``EagerVerify``, or
    ``batch(trees)``) fills the inputs, replays the smallest bucket that holds the rows and
    returns views of that graph's outputs (valid until the next call); ``sample()`` replays the
    bucket's sampling graph and returns [2, n] float64; ``greedy()`` / ``sampled()`` replay a
    tail and copy the round's result back once (as ``EagerVerify``'s); ``batch_samples()`` /
    ``path_features()`` run eagerly on the replayed outputs."""

    def __init__(self, forward: RowInvariantLlama, max_rows: int, device: torch.device, max_trees: int = 1):
        self.buckets = buckets_for(max_rows)
        super().__init__(forward, self.buckets[-1], device, max_trees)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.samplers: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.tails: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            # inputs all zero: position 0, scratch-row writes, no moves
            self._step(b)  # compile/warm the kernels outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=mempool):
                out = self._step(b)
            self.graphs[b] = (g, out)
            tail = lambda b=b, out=out: self._greedy_tail(b, *out)
            tail()
            torch.cuda.synchronize()
            gt = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gt, pool=mempool):
                tail()
            self.tails[b] = gt
            self.inputs.words.copy_(torch.tensor(sampling_words(SamplingParams(temperature=1.0))))
            for filtered in (False, True):
                sample = lambda b=b, out=out, f=filtered: self._sample_tail(b, *out, f)
                sample()
                torch.cuda.synchronize()
                gs = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gs, pool=mempool):
                    drawn = sample()
                self.samplers[b, filtered] = (gs, drawn)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} rows exceed the largest graph bucket {self.buckets[-1]}")

    def _run(self, trees):
        n = sum(len(t.tokens) for t in trees)
        self.b = b = self.bucket(n)
        self.spans = self.inputs.load_trees(trees, b)
        self.n = n
        g, (logits, feats) = self.graphs[b]
        g.replay()
        self.logits, self.feats = logits[:n], (feats[:n] if feats is not None else None)
        return self.logits, self.feats

    @torch.inference_mode()
    def sample(self, filtered: bool = True) -> torch.Tensor:
        gs, drawn = self.samplers[self.b, filtered]
        gs.replay()
        return drawn[:, :self.n]

    @torch.inference_mode()
    def greedy(self, features: bool = True) -> tuple:
        self.tails[self.b].replay()
        return self._fetch(features, False)

    @torch.inference_mode()
    def sampled(self, filtered: bool = True, features: bool = True) -> tuple:
        self.samplers[self.b, filtered][0].replay()
        return self._fetch(features, True)
