"""Row-invariant linear layer: ``out = rmsnorm?(x) @ w.T (+ residual)`` with one fixed tiling.

A library GEMM picks its algorithm, tile shape and split-K from the problem's M, so the same
row can round differently in a 1-row decode and a 64-row tree verify. This kernel uses one
tile configuration (BLOCK_M × BLOCK_N × BLOCK_K, no split-K, no per-shape autotune) for every
M: each output element is the same K-loop of the same MMA tiles, so a row's bits do not depend
on the other rows. Accumulation is float32; the optional residual is added in float32 before
the single rounding to the output dtype. The optional RMSNorm (Zhang & Sennrich 2019) is fused
in one pass: the K loop feeds ``(x · norm_weight)`` (rounded to the input dtype) to the MMA while
summing the row's squares in a fixed order, and the fp32 accumulator is scaled by
rsqrt(mean(x²) + eps) at the end — the same product in exact arithmetic, one launch and one
read of x fewer (its rounding differs from a separate RMSNorm module; the fast path uses it for
verify and decode alike).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# One tile configuration for every M (row invariance); SPECDEC_MATMUL_TILES="BM,BN,BK,warps,stages"
# overrides it for tuning sweeps (bench/kernel_sweep.py) — never per call.
BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES = (
    int(v) for v in os.environ.get("SPECDEC_MATMUL_TILES", "64,64,128,4,3").split(","))


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M
def _linear_kernel(x_ptr, w_ptr, r_ptr, o_ptr, nw_ptr, M, N, K, sxm, swn, srm, som, eps,
                   HAS_RES: tl.constexpr, NORM: tl.constexpr, RSTD: tl.constexpr, GLU: tl.constexpr,
                   IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    ss = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        xmask = (rm[:, None] < M) & (kk[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=xmask, other=0.0)
        if GLU:  # x holds [gate | up] rows of width 2K: feed silu(gate)·up, rounded once
            g = x.to(tl.float32)
            u = tl.load(x_ptr + rm[:, None] * sxm + K + kk[None, :], mask=xmask, other=0.0).to(tl.float32)
            x = (g / (1.0 + tl.exp(-g)) * u).to(x_ptr.dtype.element_ty)
        if RSTD:  # the norm weight is folded into w; only the row's sum of squares is needed
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        if NORM:  # accumulate the row's sum of squares; scale by the norm weight now, by rstd at the end
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
            nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
            x = (xf * nw[None, :]).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + rn[None, :] * swn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if NORM or RSTD:
        acc = acc * (1.0 / tl.sqrt(ss / K + eps))[:, None]
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_RES:
        acc += tl.load(r_ptr + rm[:, None] * srm + rn[None, :], mask=omask, other=0.0).to(tl.float32)
    tl.store(o_ptr + rm[:, None] * som + rn[None, :], acc.to(o_ptr.dtype.element_ty), mask=omask)


def linear(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, norm_weight: torch.Tensor | None = None,
           eps: float = 1e-5, rstd: bool = False, glu: bool = False) -> torch.Tensor:
    """x [M, K], w [N, K] (row-major, same dtype: bf16, fp16 or fp32), residual [M, N] or None,
    norm_weight [K] or None (RMSNorm x first, with eps). Returns [M, N] in ``out_dtype``
    (default x.dtype). fp32 inputs use IEEE fp32 products (no TF32). Raises ValueError on
    shape mismatch."""
    M, K = x.shape
    if glu:
        K //= 2
    N = w.shape[0]
    if w.shape[1] != K or (residual is not None and residual.shape != (M, N)):
        raise ValueError(f"linear: x {tuple(x.shape)}, w {tuple(w.shape)}, residual "
                         f"{None if residual is None else tuple(residual.shape)}")
    x = x.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=out_dtype or x.dtype)
    res = residual.contiguous() if residual is not None else out
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    nw = norm_weight if norm_weight is not None else w
    _linear_kernel[grid](x, w, res, out, nw, M, N, K, x.stride(0), w.stride(0), res.stride(0), out.stride(0), eps,
                         HAS_RES=residual is not None, NORM=norm_weight is not None, RSTD=rstd, GLU=glu, IEEE=x.dtype == torch.float32,
                         BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


def linear_reference(x, w, residual=None, out_dtype=None, norm_weight=None, eps=1e-5) -> torch.Tensor:
    """float64 reference of ``linear`` (before the final rounding)."""
    x = x.double()
    if norm_weight is not None:
        x = norm_weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    out = x @ w.double().T
    if residual is not None:
        out = out + residual.double()
    return out
