"""Row-invariant RMSNorm (Zhang & Sennrich 2019): one program per row, the whole row in one
block, float32 reduction in a fixed order. Matches ``modeling.layers.RMSNorm``'s rounding:
``weight * (x * rsqrt(mean(x²) + eps)).to(dtype)``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, o_ptr, H, sx, so, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    y = (x * rstd).to(o_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * so + cols, (y * w).to(o_ptr.dtype.element_ty), mask=m)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, H] (any float dtype), weight [H] → [M, H] in x.dtype."""
    M, H = x.shape
    x = x.contiguous()
    out = torch.empty_like(x)
    _rmsnorm_kernel[(M,)](x, weight, out, H, x.stride(0), out.stride(0), eps,
                          BLOCK=triton.next_power_of_2(H), num_warps=4)
    return out


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 reference."""
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
