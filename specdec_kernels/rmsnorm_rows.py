"""Row-wise RMSNorm (Zhang & Sennrich 2019) with one program per row holding the whole row, so a
row's bits never depend on how many rows share the launch (a library reduction picks its
split from the tensor's shape). Rounded like ``modeling.layers.RMSNorm``:
``weight · (x · rsqrt(mean(x²) + eps)).to(dtype)``. Used before every matmul of the fast
paths (fusing it into the matmul's K loop was slower on the H200: bench/results/verify_variants_h200.json).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, N, sx, so, eps, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < N
    x = tl.load(x_ptr + i * sx + c, mask=ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = (x * r).to(o_ptr.dtype.element_ty)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + i * so + c, w * y, mask=ok)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, N] (any float dtype, last dim contiguous), weight [N] → [M, N] in x.dtype."""
    M, N = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.stride(-1) != 1:
        x = x.contiguous()
    _rmsnorm_kernel[(M,)](x, weight, out, N, x.stride(0), out.stride(0), eps,
                          BLOCK=triton.next_power_of_2(N), num_warps=4 if N <= 4096 else 8)
    return out


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 reference."""
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
