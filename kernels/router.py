"""MoE router logits ``x @ w.T`` in float32 for few rows, row-invariant, on CUDA cores.

A DeepSeek-V3 / Kimi-K2 router (N = 256–384 experts, K = 7168) stays float32 so that expert
selection does not depend on the compute dtype (``modeling.deepseek.MoE.router_logits``). Through
``kernels.matmul.linear`` that is an IEEE-fp32 ``tl.dot`` (FMA units, 16-row tiles: 27.6 µs at 8
rows and 97 µs at 65 on the H200 for ~11 MB of weights, a 2.6-µs read). Here each program owns
``BR`` rows × ``BN`` experts over the whole K: per K block it adds the elementwise products
x[r, k]·w[n, k] into a [BR, BN, BK] float32 accumulator (one product-add per element, so each
(r, n, k-lane) sum is the same sequence of operations whatever the lane's row or expert), and
after the K loop one ``tl.sum`` over the BK lanes gives the logit. BR, BN and BK are constants,
never a function of M, so a row's bits are the same in a one-row decode and in a 65-row tree
verify (a row's place inside its block does not change its arithmetic: the layout's K mapping is
the same for every (r, n)). x is read in its own dtype (bf16 hidden states) and widened exactly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BR, BN, BK = 8, 4, 256  # rows × experts per program, K positions per step (fixed: part of the arithmetic)


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M
def _router_kernel(x_ptr, w_ptr, o_ptr, M, N, K, sxm, swn, som,
                   BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BR + tl.arange(0, BR)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BR, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None] * swn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        acc += x[:, None, :] * w[None, :, :]
    out = tl.sum(acc, 2)
    tl.store(o_ptr + rm[:, None] * som + rn[None, :], out, mask=(rm[:, None] < M) & (rn[None, :] < N))


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32), w [N, K] float32 (row-major) → logits [M, N] float32,
    each the float32 sum of float32 products (x widened exactly). Raises ValueError on a shape
    mismatch or a non-float32 weight."""
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K or w.dtype != torch.float32:
        raise ValueError(f"router_logits: x {tuple(x.shape)}, w {tuple(w.shape)} {w.dtype} (need [N, {K}] float32)")
    x = x.contiguous()
    w = w.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=torch.float32)
    _router_kernel[(triton.cdiv(M, BR), triton.cdiv(N, BN))](x, w, out, M, N, K, x.stride(0), w.stride(0),
                                                            out.stride(0), BR=BR, BN=BN, BK=BK, num_warps=4)
    return out


def router_logits_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 reference of ``router_logits``."""
    return x.double() @ w.double().T
