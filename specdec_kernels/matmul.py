"""Row-invariant linear layer: ``out = x @ w.T (+ residual)`` with one fixed tiling per weight.

A library GEMM picks its algorithm, tile shape and split-K from the problem's M, so the same
row can round differently in a 1-row decode and a 64-row tree verify. This kernel's tile
configuration (BLOCK_M × BLOCK_N × BLOCK_K and a split-K count S) is a function of the weight's
shape (N, K) only — never of M — so each output element is the same K-loop of the same MMA tiles
whatever other rows share the launch, and a row's bits do not depend on them. Accumulation is
float32. With S > 1 (wide-K weights at few rows: the N tiles alone leave most SMs idle) program s
folds the s-th of S equal runs of whole K blocks into a float32 partial and a second launch adds
the S partials in order s = 0, 1, …, S − 1 — a fixed order, so still no dependence on M (no
atomics). The optional residual is added in float32 before the single rounding to the output
dtype. RMSNorm stays a separate row kernel (``specdec_kernels.rmsnorm_rows``): fused as a prologue of
the K loop it cost 0.3–1.1 ms more per verify on the H200 (bench/results/verify_variants_h200.json, script at 22befbe), because
the x tile then passes through registers instead of the pipelined shared-memory path.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

Tiles = tuple[int, ...]  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, split-K count S, default 1])

# The tiling of a weight of shape (N, K); SPECDEC_MATMUL_TILES="BM,BN,BK,warps,stages" forces one
# tiling for every weight (tuning sweeps). Chosen on the H200 by bench/kernel_tiles.py
# (bench/results/kernel_tiles_h200.json): narrow tiles for the small SmolLM2-135M projections
# (more programs at 1–65 rows), a wide one for the LM head; balanced so 257/513-row verifies
# stay within ~10% of the old uniform 64×64×128.
DEFAULT_TILES: Tiles = (64, 64, 128, 4, 3)
_FORCED = os.environ.get("SPECDEC_MATMUL_TILES")
TILE_TABLE: dict[tuple[int, int], Tiles] = {
    (960, 576): (64, 32, 128, 4, 3), (576, 576): (64, 32, 128, 4, 3), (3072, 576): (64, 32, 64, 4, 3),
    (576, 1536): (64, 32, 128, 4, 3), (49152, 576): (64, 128, 64, 4, 3),
    (576, 1728): (16, 32, 256, 4, 3), (384, 576): (64, 32, 128, 4, 3),
    # one Kimi-K2 rank under TP8 (bench/kernel_tiles.py --kimi-tp8 --split, bench/results/kernel_tiles_kimi_tp8_split.json,
    # session 17: split-K 4-14 for the 7168- and 4096-wide inputs, 0.27-0.65 of the default's time at 1-17 rows, 0.41-0.65
    # of session 16's unsplit tilings; shapes where the default won are left out)
    (1536, 7168): (64, 64, 128, 4, 3, 4), (1536, 1536): (64, 32, 128, 4, 3), (576, 7168): (64, 64, 128, 4, 3, 14),
    (4096, 1024): (64, 32, 128, 4, 3), (1024, 4096): (64, 64, 128, 4, 3, 7), (256, 7168): (64, 64, 128, 4, 3, 14),
    (7168, 256): (64, 64, 64, 4, 3), (2304, 7168): (64, 64, 128, 4, 3, 7), (20480, 7168): (32, 128, 128, 4, 3),
    # the shared expert's gate and up stacked (modeling.deepseek_fast.stack_gate_up_; session 20's sweep of that one
    # shape: 6.3 / 6.4 / 7.5 / 10.2 µs at 1 / 8 / 17 / 65 rows against the default's 22.4-22.9)
    (512, 7168): (64, 64, 128, 4, 3, 14)}


def tiles_for(n: int, k: int) -> Tiles:
    """The fixed tiling of an (n, k) weight — a function of the weight's shape only."""
    if _FORCED:
        return tuple(int(v) for v in _FORCED.split(","))
    return TILE_TABLE.get((n, k), DEFAULT_TILES)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M
def _linear_kernel(x_ptr, w_ptr, r_ptr, o_ptr, M, N, K, KS, NS, sxm, swn, srm, som, sxh, swh, soh,
                   HAS_RES: tl.constexpr, IEEE: tl.constexpr, PARTIAL: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, WIDE: tl.constexpr = False):
    """WIDE: row offsets in int64 (a tensor of ≥ 2^31 elements). Program (m, n, head·NS + s): rows m·BM…, columns n·BN… of one head's matmul (x, w, out offset by
    head times sxh / swh / soh; one head: 0) over K positions [s·KS, (s+1)·KS) (KS a multiple of BK, or
    K). PARTIAL (one head only): store the float32 fold at o_ptr's s-th [M, N] slice."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2) % NS
    head = tl.program_id(2) // NS
    x_ptr += head * sxh
    w_ptr += head * swh
    o_ptr += head * soh
    rm = pid_m * BM + tl.arange(0, BM)
    if WIDE:
        rm = rm.to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k_end = tl.minimum(K, (pid_s + 1) * KS)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(pid_s * KS, k_end, BK):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    if PARTIAL:
        tl.store(o_ptr + pid_s.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :], acc, mask=omask)
    else:
        if HAS_RES:
            acc += tl.load(r_ptr + rm[:, None] * srm + rn[None, :], mask=omask, other=0.0).to(tl.float32)
        tl.store(o_ptr + rm[:, None] * som + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["M"])
def _split_sum_kernel(p_ptr, r_ptr, o_ptr, M, N, srm, som, S: tl.constexpr, HAS_RES: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr):
    """out = ((p[0] + p[1]) + … + p[S−1]) (+ residual), float32, then one rounding: p [S, M, N]."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    at = rm[:, None] * N + rn[None, :]
    mn = M.to(tl.int64) * N  # one partial's elements (int64: S·M·N may pass 2^31)
    acc = tl.load(p_ptr + at, mask=mask, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(p_ptr + s * mn + at, mask=mask, other=0.0)
    if HAS_RES:
        acc += tl.load(r_ptr + rm[:, None] * srm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + rm[:, None] * som + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=mask)


def linear(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """x [M, K], w [N, K] (row-major, same dtype: bf16, fp16 or fp32), residual [M, N] or None.
    Returns [M, N] in ``out_dtype`` (default x.dtype). ``tiles`` overrides ``tiles_for(N, K)``
    (sweeps only: a caller must use one tiling per weight). fp32 inputs use IEEE fp32 products
    (no TF32). Raises ValueError on shape mismatch."""
    M, K = x.shape
    N = w.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.dtype != x.dtype:
        raise ValueError(f"linear: x and w must share bf16, fp16 or fp32, got {x.dtype}, {w.dtype}")
    if w.shape[1] != K or (residual is not None and residual.shape != (M, N)):
        raise ValueError(f"linear: x {tuple(x.shape)}, w {tuple(w.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}")
    bm, bn, bk, warps, stages, split = (*(tiles or tiles_for(N, K)), 1)[:6]
    if type(split) is not int or split < 1:
        raise ValueError(f"linear: the split-K count (tiles[5]) must be an int >= 1, got {split!r}")
    x = x.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=out_dtype or x.dtype)
    res = residual.contiguous() if residual is not None else out
    ks, split = split_k(K, bk, split)
    part = torch.empty(split, M, N, device=x.device, dtype=torch.float32) if split > 1 else out
    _linear_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), split)](
        x, w, res, part, M, N, K, ks, split, x.stride(0), w.stride(0), res.stride(0), out.stride(0), 0, 0, 0,
        HAS_RES=residual is not None, IEEE=x.dtype == torch.float32, PARTIAL=split > 1, BM=bm, BN=bn, BK=bk,
        WIDE=_wide(M, K, N), num_warps=warps, num_stages=stages)
    if split > 1:
        split_sum(part, out, residual=None if residual is None else res)
    return out


def _wide(M: int, *widths: int) -> bool:
    """Whether row offsets of M rows at these row widths / strides (or M·N partials) may pass int32."""
    return M * max(widths, default=0) >= 2**31 - 2**20


# per-head matmuls (``head_linear``) by their weight's per-head shape (N, K): one tiling each, never a function of M
HEAD_TILES: dict[tuple[int, int], Tiles] = {}
DEFAULT_HEAD_TILES: Tiles = (16, 64, 128, 4, 3)


def head_linear(x: torch.Tensor, w: torch.Tensor, tiles: Tiles | None = None) -> torch.Tensor:
    """Per-head (batched) row-invariant matmul: out[:, i] = x[:, i] @ w[i].T for each of h heads, in one
    launch — MLA's absorbed W_UK / W_UV (DeepSeek-V2 §2.1.2) without a block-diagonal matrix (h× the
    bytes) or h launches. x [M, h, K] (any strides, last dim contiguous), w [h, N, K] (last dim contiguous),
    one dtype (bf16, fp16 or fp32; fp32 with IEEE products). Returns [M, h, N] contiguous in x's dtype.
    The tiling is ``HEAD_TILES[(N, K)]`` (default ``DEFAULT_HEAD_TILES``; ``tiles`` overrides it, sweeps
    only), no split-K, so a row's bits depend on neither M nor the other rows. Raises ValueError on
    mismatched shapes or dtypes."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"head_linear: x {tuple(x.shape)}, w {tuple(w.shape)}: need x [M, h, K], w [h, N, K]")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or w.dtype != x.dtype:
        raise ValueError(f"head_linear: x and w must share bf16, fp16 or fp32, got {x.dtype}, {w.dtype}")
    M, h, K = x.shape
    N = w.shape[1]
    t = tuple(tiles or HEAD_TILES.get((N, K), DEFAULT_HEAD_TILES))
    if len(t) not in (5, 6) or (len(t) == 6 and t[5] != 1):
        raise ValueError(f"head_linear: tiles must be (BM, BN, BK, warps, stages) (no split-K), got {tiles!r}")
    bm, bn, bk, warps, stages = t[:5]
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(M, h, N, device=x.device, dtype=x.dtype)
    if M and h and N:
        _linear_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), h)](
            x, w, out, out, M, N, K, max(K, 1), 1, x.stride(0), w.stride(1), out.stride(0), out.stride(0),
            x.stride(1), w.stride(0), out.stride(1), HAS_RES=False, IEEE=x.dtype == torch.float32, PARTIAL=False,
            BM=bm, BN=bn, BK=bk, WIDE=_wide(M, x.stride(0), out.stride(0)), num_warps=warps, num_stages=stages)
    return out


def split_k(K: int, bk: int, split: int) -> tuple[int, int]:
    """(KS, S): the K positions per split-K program — whole blocks of ``bk``, ⌈⌈K/bk⌉/split⌉ of them —
    and the number of programs that covers K with it (≤ split; 1 where K = 0). Every kernel that
    must fold K as ``linear`` does (``specdec_kernels.moe``) takes its runs from here."""
    ks = triton.cdiv(max(triton.cdiv(K, bk), 1), split) * bk
    return ks, max(triton.cdiv(K, ks), 1)


def split_sum(part: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] ← ((part[0] + part[1]) + … + part[S−1]) (+ residual [M, N]) in float32, rounded
    once to out's dtype: the second launch of a split-K ``linear``. part [S, M, N] float32,
    contiguous; out and residual with unit column stride. Returns out."""
    S, M, N = part.shape
    res = out if residual is None else residual
    _split_sum_kernel[(triton.cdiv(M, 32), triton.cdiv(N, 128))](
        part, res, out, M, N, res.stride(0), out.stride(0), S=S, HAS_RES=residual is not None,
        BM=32, BN=128, num_warps=4)
    return out


def linear_reference(x, w, residual=None, out_dtype=None) -> torch.Tensor:
    """float64 reference of ``linear`` (before the final rounding)."""
    out = x.double() @ w.double().T
    if residual is not None:
        out = out + residual.double()
    return out
