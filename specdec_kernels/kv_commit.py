"""KV commit inside the verify graph: move the accepted path's K/V rows into place, one launch
(DDTree/SpecInfer commit: accepted rows gathered to [length, length + m), the rest dropped).

``moves`` [2, C] int64 holds absolute pool rows (src row, dst row) per path entry; entries with
src == dst (already in place, and the zero padding → the scratch row) are skipped. One program
per layer loads every moved row of K and V, waits at a barrier, then stores them, so a row that
is both a destination and a later source is read before it is overwritten (dst i ≤ src i, as
path offsets ascend).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_MOVES = 16  # path rows moved on the device (a longer path is committed by the host)


@triton.jit
def _kv_move_kernel(k_ptr, v_ptr, moves_ptr, s_layer, ROW: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr,
                    HAS_V: tl.constexpr = True):
    base = tl.program_id(0).to(tl.int64) * s_layer
    c = tl.arange(0, C)
    moves_ptr += tl.program_id(1) * 2 * C  # this group's (src | dst) rows
    src = tl.load(moves_ptr + c)
    dst = tl.load(moves_ptr + C + c)
    cols = tl.arange(0, BLOCK)
    m = (src != dst)[:, None] & (cols < ROW)[None, :]
    k = tl.load(k_ptr + base + src[:, None] * ROW + cols[None, :], mask=m)
    if HAS_V:
        v = tl.load(v_ptr + base + src[:, None] * ROW + cols[None, :], mask=m)
    tl.debug_barrier()
    tl.store(k_ptr + base + dst[:, None] * ROW + cols[None, :], k, mask=m)
    if HAS_V:
        tl.store(v_ptr + base + dst[:, None] * ROW + cols[None, :], v, mask=m)


def kv_move(k: torch.Tensor, v: torch.Tensor | None, moves: torch.Tensor) -> None:
    """k, v: pool tensors [layers, rows, kv_heads, head_dim] (contiguous, same shape; v None: an
    MLA latent pool, k [layers, rows, C + R]); moves:
    [G · 2 · MAX_MOVES] int64 on their device: G groups of (src rows | dst rows), e.g. one per
    request of a batched verify (groups must not share rows; one program per (layer, group)).
    In place; no host sync."""
    layers, rows = k.shape[:2]
    row = k[0, 0].numel()
    groups = moves.numel() // (2 * MAX_MOVES)
    _kv_move_kernel[(layers, groups)](k, k if v is None else v, moves, rows * row, ROW=row, C=MAX_MOVES,
                                      BLOCK=triton.next_power_of_2(row), num_warps=4, HAS_V=v is not None)


def kv_move_reference(k: torch.Tensor, v: torch.Tensor, moves: torch.Tensor) -> None:
    for group in moves.view(-1, 2, MAX_MOVES):
        src, dst = group
        keep = src != dst
        for t in (k, v):
            if t is not None:
                t[:, dst[keep]] = t[:, src[keep]]
