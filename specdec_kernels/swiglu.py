"""SwiGLU activation ``silu(gate) · up`` on a fused [gate | up] projection, float32 inside,
one rounding (row-invariant: purely elementwise)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _swiglu_kernel(gu_ptr, o_ptr, I, s_gu, s_o, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(gu_ptr + r * s_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * s_gu + I + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + r * s_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(o_ptr.dtype.element_ty), mask=m)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [R, 2·I] → [R, I] in the same dtype."""
    R, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(R, inter, device=gate_up.device, dtype=gate_up.dtype)
    _swiglu_kernel[(R, triton.cdiv(inter, BLOCK))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                  BLOCK=BLOCK, num_warps=4)
    return out


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.double().chunk(2, -1)
    return torch.nn.functional.silu(g) * u
