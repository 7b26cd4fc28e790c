"""Verify forward entry points for the GPU: inputs built on the host and sent in one copy,
then the row-invariant forward run eagerly or replayed from CUDA graphs, one per row bucket
(nano-vllm's scheme, shifted by the root row: buckets 1, 2, 3, 5, 9, then every 16 from 17 up
to the largest tree; captured largest first into one memory pool; padded rows made harmless
before every replay). A greedy verify's result (samples, accepted path, its features) comes
back in one copy, and the previous tree's commit runs inside the forward (``kernels.kv_commit``).

Padded rows (bucket − n of them) take token 0 at position L with the root as their only
ancestor and write their K/V to the pool's scratch row 0, so nothing of an earlier, larger
tree can reach a real row.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from kernels.kv_commit import MAX_MOVES, kv_move
from modeling.fast_forward import RowInvariantLlama
from modeling.sampling import SamplingParams, sample_tree_device, sampling_words

PATH_MAX = MAX_MOVES  # accepted-path rows whose features the greedy tail gathers on the device


def buckets_for(max_rows: int) -> list[int]:
    """Row buckets covering 1…max_rows: 1, 2, 3, 5, 9, then every 16 from 17, so a tree of a
    power-of-two budget (root + 2^k nodes) fills its bucket without padded rows."""
    small = [b for b in (1, 2, 3, 5, 9) if b < max_rows]
    return small + list(range(17, max_rows + 16, 16)) if max_rows > 9 else small + [max_rows]


class TreeInputs:
    """One int64 buffer on the device holding a verify's inputs, filled from a pinned host
    mirror with a single copy. Layout (R = max rows, C = ``kernels.kv_commit.MAX_MOVES``):
    tokens [0, R), positions [R, 2R), slots [2R, 3R), meta (base, L, W) [3R, 3R+3), sampling
    words [3R+3, 3R+7) (``modeling.sampling.sampling_words``; sampled requests only), KV moves
    of the previous tree's commit (src rows | dst rows) [3R+7, 3R+7+2C), ancestors [3R+7+2C, …)
    flat with row stride W."""

    def __init__(self, max_rows: int, device: torch.device):
        R = self.R = max_rows
        self.a = 3 * R + 7 + 2 * MAX_MOVES  # ancestors offset
        size = self.a + R * R
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.host_t = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host = self.host_t.numpy()

    def views(self, rows: int) -> tuple[torch.Tensor, ...]:
        """(tokens, positions, slots, ancestors, meta) device views for a forward of ``rows``."""
        R, d = self.R, self.dev
        return d[:rows], d[R:R + rows], d[2 * R:2 * R + rows], d[self.a:], d[3 * R:3 * R + 3]

    @property
    def words(self) -> torch.Tensor:
        return self.dev[3 * self.R + 3:3 * self.R + 7]

    @property
    def moves(self) -> torch.Tensor:
        return self.dev[3 * self.R + 7:self.a]

    def load(self, tokens: list[int], depths: np.ndarray, ancestors: np.ndarray, base: int, L: int,
             rows: int, words: list[int] | None = None, moves: list[tuple[int, int]] = ()) -> None:
        """Fill rows [0, n) from the tree (n = len(tokens); ancestors [n, W] from
        ``modeling.tree.tree_ancestors``) and rows [n, rows) as padding, the sampling words if
        given, and the KV moves (absolute (src, dst) pool rows, ≤ MAX_MOVES; none = all zero, so
        a stale move never repeats); copy to the device."""
        R, h, n = self.R, self.host, len(tokens)
        w = ancestors.shape[1]
        h[:n] = tokens
        h[n:rows] = 0
        h[R:R + n] = L + depths
        h[R + n:R + rows] = L
        h[2 * R:2 * R + n] = np.arange(base + L, base + L + n)
        h[2 * R + n:2 * R + rows] = 0  # padded rows write the scratch row
        h[3 * R:3 * R + 3] = (base, L, w)
        if words is not None:
            h[3 * R + 3:3 * R + 7] = words
        m = 3 * R + 7
        h[m:self.a] = 0
        for i, (src, dst) in enumerate(moves):
            h[m + i], h[m + MAX_MOVES + i] = src, dst
        a = self.a
        h[a:a + n * w] = ancestors.reshape(-1)
        h[a + n * w:a + rows * w] = 0
        end = a + rows * w
        self.dev[:end].copy_(self.host_t[:end], non_blocking=True)


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


class _Verify:
    """Shared by the eager and the graphed verify: the input buffer and a result buffer on the
    device with a pinned host mirror, so a round's result comes back in one copy. Result layout
    (R = max rows): int64 (end node, end depth, samples [R]), float64 edge probabilities [R]
    (sampled rounds), then the end node's root-path features [PATH_MAX, F] in the model dtype."""

    def __init__(self, forward: RowInvariantLlama, max_rows: int, device: torch.device):
        self.forward, self.inputs = forward, TreeInputs(max_rows, device)
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

    def _step(self, rows: int):
        """KV moves of the commit, then the forward over the first ``rows`` input rows."""
        kv_move(self.forward.pool.k, self.forward.pool.v, self.inputs.moves)
        return self.forward(*self.inputs.views(rows))

    def _greedy_tail(self, rows: int, logits, feats) -> None:
        tokens, positions, _, ancestors, meta = self.inputs.views(rows)
        path_tail(logits.argmax(-1), feats, tokens, positions, ancestors, meta, self.out_ints, self.out_feats)

    def _sample_tail(self, rows: int, logits, feats, filtered: bool) -> torch.Tensor:
        """Sample the tree (``sample_tree_device``), then the path and its features; returns
        the [2, rows] float64 draws (samples, edge probabilities)."""
        tokens, positions, _, ancestors, meta = self.inputs.views(rows)
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
        self.out_host[:end].copy_(self.out[:end], non_blocking=True)
        if self.out.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        ints = self.host_ints[:2 + n].tolist()
        edge = self.host_edges[:n].tolist() if edges else None
        return ints[2:], edge, ints[0], ints[1], (self.host_feats if feats else None)


class EagerVerify(_Verify):
    """The row-invariant forward without graphs (``--no-graphs``). Call with (tokens, depths,
    ancestors, base, L[, words[, moves]]) host values; returns (logits [n, V] float32, features
    [n, taps·H]). ``sample()`` then returns the last tree's [2, n] float64 samples and edge
    probabilities (``modeling.sampling.sample_tree_device`` with the words given); ``greedy()``
    and ``sampled()`` the samples (and edge probabilities), the matching path's end node and
    depth and its features (``path_tail``) in one copy back."""

    @torch.inference_mode()
    def __call__(self, tokens, depths, ancestors, base, L, words=None, moves=()):
        self.n = n = len(tokens)
        self.inputs.load(tokens, depths, ancestors, base, L, n, words, moves)
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
    """Captured ``RowInvariantLlama`` forwards (each preceded by the commit's KV moves), and per
    bucket three graphs reading that forward's outputs: the greedy tail and the tree samplers
    of sampled requests (with and without top-k/top-p filtering), each ending in ``path_tail``.
    ``max_rows`` = root + max tree nodes. A call (same arguments as ``EagerVerify``) fills the
    inputs, replays the smallest bucket that holds the tree and returns views of that graph's
    outputs (valid until the next call); ``sample()`` replays the bucket's sampling graph and
    returns [2, n] float64; ``greedy()`` / ``sampled()`` replay a tail and copy the round's
    result back once (as ``EagerVerify``'s)."""

    def __init__(self, forward: RowInvariantLlama, max_rows: int, device: torch.device):
        self.buckets = buckets_for(max_rows)
        super().__init__(forward, self.buckets[-1], device)
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

    @torch.inference_mode()
    def __call__(self, tokens, depths, ancestors, base, L, words=None, moves=()):
        self.n = n = len(tokens)
        self.b = b = self.bucket(n)
        self.inputs.load(tokens, depths, ancestors, base, L, b, words, moves)
        g, (logits, feats) = self.graphs[b]
        g.replay()
        return logits[:n], (feats[:n] if feats is not None else None)

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
