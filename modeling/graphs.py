"""CUDA graphs of the row-invariant verify forward, one per row bucket (nano-vllm's scheme:
buckets 1, 2, 4, 8, then every 16 up to the largest tree; captured largest first into one
memory pool; static input buffers; padded rows made harmless before every replay).

Padded rows (bucket − n of them) take token 0 at position L with the root as their only
ancestor and write their K/V to the pool's scratch row 0, so nothing of an earlier, larger
tree can reach a real row.
"""
from __future__ import annotations

import time

import torch

from modeling.fast_forward import RowInvariantLlama


def buckets_for(max_rows: int) -> list[int]:
    """Row buckets covering 1…max_rows."""
    small = [b for b in (1, 2, 4, 8) if b < max_rows]
    return small + list(range(16, max_rows + 16, 16)) if max_rows > 8 else small + [max_rows]


class VerifyGraphs:
    """Captured ``RowInvariantLlama`` forwards. ``max_rows`` = root + max tree nodes.

    ``run`` copies the inputs into the static buffers, replays the smallest bucket that holds
    them and returns views of that graph's outputs (valid until the next ``run``)."""

    def __init__(self, forward: RowInvariantLlama, max_rows: int, device: torch.device):
        self.forward, self.device = forward, device
        self.buckets = buckets_for(max_rows)
        R = self.buckets[-1]
        self.tokens = torch.zeros(R, dtype=torch.int64, device=device)
        self.positions = torch.zeros(R, dtype=torch.int64, device=device)
        self.slots = torch.zeros(R, dtype=torch.int64, device=device)
        self.ancestors = torch.zeros(R, R, dtype=torch.int32, device=device)
        self.meta = torch.zeros(2, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            args = (self.tokens[:b], self.positions[:b], self.slots[:b], self.ancestors[:b], self.meta)
            self.forward(*args)  # compile/warm the kernels outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=mempool):
                out = self.forward(*args)
            self.graphs[b] = (g, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0

    def bucket(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"{n} rows exceed the largest graph bucket {self.buckets[-1]}")

    @torch.inference_mode()
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            ancestors: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same arguments and results as ``RowInvariantLlama.__call__`` (device tensors)."""
        n, w = ancestors.shape
        b = self.bucket(n)
        self.tokens[:n].copy_(tokens)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.ancestors[:n, :w].copy_(ancestors)
        self.meta.copy_(meta)
        if b > n:  # padded rows: root-only, at position L, writing to the scratch row
            self.tokens[n:b].zero_()
            self.positions[n:b].copy_(meta[1].expand(b - n))
            self.slots[n:b].zero_()
            self.ancestors[n:b, 0].zero_()
        g, (logits, feats) = self.graphs[b]
        g.replay()
        return logits[:n], (feats[:n] if feats is not None else None)

    __call__ = run
