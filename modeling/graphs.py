"""Verify forward entry points for the GPU: inputs built on the host and sent in one copy,
then the row-invariant forward run eagerly or replayed from CUDA graphs, one per row bucket
(nano-vllm's scheme: buckets 1, 2, 4, 8, then every 16 up to the largest tree; captured
largest first into one memory pool; padded rows made harmless before every replay).

Padded rows (bucket − n of them) take token 0 at position L with the root as their only
ancestor and write their K/V to the pool's scratch row 0, so nothing of an earlier, larger
tree can reach a real row.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from modeling.fast_forward import RowInvariantLlama
from modeling.sampling import SamplingParams, sample_tree_device, sampling_words


def buckets_for(max_rows: int) -> list[int]:
    """Row buckets covering 1…max_rows."""
    small = [b for b in (1, 2, 4, 8) if b < max_rows]
    return small + list(range(16, max_rows + 16, 16)) if max_rows > 8 else small + [max_rows]


class TreeInputs:
    """One int64 buffer on the device holding a verify's inputs, filled from a pinned host
    mirror with a single copy. Layout (R = max rows): tokens [0, R), positions [R, 2R), slots
    [2R, 3R), meta (base, L, W) [3R, 3R+3), sampling words [3R+3, 3R+7)
    (``modeling.sampling.sampling_words``; sampled requests only), ancestors [3R+7, …) flat with
    row stride W."""

    def __init__(self, max_rows: int, device: torch.device):
        R = self.R = max_rows
        size = 3 * R + 7 + R * R
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.host_t = torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.host = self.host_t.numpy()

    def views(self, rows: int) -> tuple[torch.Tensor, ...]:
        """(tokens, positions, slots, ancestors, meta) device views for a forward of ``rows``."""
        R, d = self.R, self.dev
        return d[:rows], d[R:R + rows], d[2 * R:2 * R + rows], d[3 * R + 7:], d[3 * R:3 * R + 3]

    @property
    def words(self) -> torch.Tensor:
        return self.dev[3 * self.R + 3:3 * self.R + 7]

    def load(self, tokens: list[int], depths: np.ndarray, ancestors: np.ndarray, base: int, L: int,
             rows: int, words: list[int] | None = None) -> None:
        """Fill rows [0, n) from the tree (n = len(tokens); ancestors [n, W] from
        ``modeling.tree.tree_ancestors``) and rows [n, rows) as padding, and the sampling words
        if given; copy to the device."""
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
        a = 3 * R + 7
        h[a:a + n * w] = ancestors.reshape(-1)
        h[a + n * w:a + rows * w] = 0
        end = a + rows * w
        self.dev[:end].copy_(self.host_t[:end], non_blocking=True)


class EagerVerify:
    """The row-invariant forward without graphs (``--no-graphs``). Call with (tokens, depths,
    ancestors, base, L[, words]) host values; returns (logits [n, V] float32, features
    [n, taps·H]). ``sample()`` then returns the last tree's [2, n] float64 samples and edge
    probabilities (``modeling.sampling.sample_tree_device`` with the words given)."""

    def __init__(self, forward: RowInvariantLlama, max_rows: int, device: torch.device):
        self.forward, self.inputs = forward, TreeInputs(max_rows, device)

    @torch.inference_mode()
    def __call__(self, tokens, depths, ancestors, base, L, words=None):
        self.n = n = len(tokens)
        self.inputs.load(tokens, depths, ancestors, base, L, n, words)
        self.logits, feats = self.forward(*self.inputs.views(n))
        return self.logits, feats

    @torch.inference_mode()
    def sample(self, filtered: bool = True) -> torch.Tensor:
        tokens, positions, _, ancestors, meta = self.inputs.views(self.n)
        return sample_tree_device(self.logits, tokens, positions, ancestors, meta, self.inputs.words, filtered)


class VerifyGraphs:
    """Captured ``RowInvariantLlama`` forwards, and per bucket two graphs that sample the tree
    from that forward's logits (sampled requests; with and without top-k/top-p filtering). ``max_rows`` = root + max tree nodes.
    A call (same arguments as ``EagerVerify``) fills the inputs, replays the smallest bucket
    that holds the tree and returns views of that graph's outputs (valid until the next call);
    ``sample()`` replays the bucket's sampling graph and returns [2, n] float64."""

    def __init__(self, forward: RowInvariantLlama, max_rows: int, device: torch.device):
        self.forward = forward
        self.buckets = buckets_for(max_rows)
        self.inputs = TreeInputs(self.buckets[-1], device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.samplers: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            args = self.inputs.views(b)  # all zeros: position 0, scratch-row writes
            self.forward(*args)  # compile/warm the kernels outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=mempool):
                out = self.forward(*args)
            self.graphs[b] = (g, out)
            self.inputs.words.copy_(torch.tensor(sampling_words(SamplingParams(temperature=1.0))))
            for filtered in (False, True):
                sample = lambda f=filtered: sample_tree_device(out[0], args[0], args[1], args[3], args[4],
                                                               self.inputs.words, f)
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
    def __call__(self, tokens, depths, ancestors, base, L, words=None):
        self.n = n = len(tokens)
        self.b = b = self.bucket(n)
        self.inputs.load(tokens, depths, ancestors, base, L, b, words)
        g, (logits, feats) = self.graphs[b]
        g.replay()
        return logits[:n], (feats[:n] if feats is not None else None)

    @torch.inference_mode()
    def sample(self, filtered: bool = True) -> torch.Tensor:
        gs, drawn = self.samplers[self.b, filtered]
        gs.replay()
        return drawn[:, :self.n]
