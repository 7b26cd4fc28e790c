"""The MLA projection's epilogue in one launch (row-invariant): after the q and kv_a projections
and the W_UK absorption, build each row's absorbed query q_lat ‖ RoPE(q_pe) per head and its
latent cache row RMSNorm(c_kv) ‖ RoPE(k_pe) (DeepSeek-V2 §2.1.3, decoupled RoPE; the RoPE pairs
are interleaved, (x[2i], x[2i+1]), as the DeepSeek-V3 checkpoints' convention).

It replaces ~17 small torch launches per layer (two interleaved RoPEs as views, products, a
stack and a copy each, the latent RMSNorm, two concatenations); one program per row, so a row's
bits depend on that row alone. RoPE is computed in float32 from the cos/sin tables as given and
rounded once; the RMSNorm rounds like ``modeling.layers.RMSNorm``:
``weight · (x · rsqrt(mean(x²) + eps)).to(dtype)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

HEADS_PER_STEP = 8  # heads a program copies / rotates per loop step (bounds its registers at 128 heads)


@triton.jit
def _rope_pairs(src, dst, c, s, j, ok):
    """Rotate interleaved pairs src[2j], src[2j+1] (any leading broadcast shape of pointers) by c, s."""
    a = tl.load(src + 2 * j, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(src + 2 * j + 1, mask=ok, other=0.0).to(tl.float32)
    tl.store(dst + 2 * j, (a * c - b * s).to(dst.dtype.element_ty), mask=ok)
    tl.store(dst + 2 * j + 1, (b * c + a * s).to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _mla_project_kernel(q_ptr, ql_ptr, ckv_ptr, w_ptr, cos_ptr, sin_ptr, oq_ptr, ol_ptr, eps,
                        s_q, s_qh, s_ql, s_qlh, s_ckv, s_cos, s_sin, s_oq, s_oqh, s_ol,
                        H: tl.constexpr, N: tl.constexpr, C: tl.constexpr, HALF: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, HB: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # (row offsets pass 2^31 elements at T·h·(C + R) ≥ 2^31)
    j = tl.arange(0, BLOCK_HALF)
    jok = j < HALF
    c = tl.load(cos_ptr + t * s_cos + j, mask=jok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * s_sin + j, mask=jok, other=0.0).to(tl.float32)
    col = tl.arange(0, BLOCK_C)
    cok = col < C
    # latent row: RMSNorm(c_kv) ‖ RoPE(k_pe)
    x = tl.load(ckv_ptr + t * s_ckv + col, mask=cok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / C + eps)
    dt = ol_ptr.dtype.element_ty
    w = tl.load(w_ptr + col, mask=cok, other=0.0).to(dt)
    tl.store(ol_ptr + t * s_ol + col, w * (x * r).to(dt), mask=cok)
    _rope_pairs(ckv_ptr + t * s_ckv + C, ol_ptr + t * s_ol + C, c, s, j, jok)
    # queries: q_lat copied, q_pe rotated, HB heads at a time
    for h0 in range(0, H, HB):
        hd = h0 + tl.arange(0, HB)
        hok = (hd < H)[:, None]
        lat = tl.load(ql_ptr + t * s_ql + hd[:, None] * s_qlh + col[None, :], mask=hok & cok[None, :])
        tl.store(oq_ptr + t * s_oq + hd[:, None] * s_oqh + col[None, :], lat, mask=hok & cok[None, :])
        _rope_pairs(q_ptr + t * s_q + hd[:, None] * s_qh + N, oq_ptr + t * s_oq + hd[:, None] * s_oqh + C,
                    c[None, :], s[None, :], j[None, :], hok & jok[None, :])


def mla_project(q: torch.Tensor, q_lat: torch.Tensor, ckv: torch.Tensor, norm_w: torch.Tensor, eps: float,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed queries and the new latent rows of T rows.

    q [T, h, N + R] (the q projection: nope ‖ rope part per head; last dim contiguous), q_lat
    [T, h, C] (q_nope · W_UK per head), ckv [T, C + R] (the kv_a projection: c_kv ‖ k_pe), norm_w
    [C] (kv_a_layernorm), cos / sin [T, R/2] (the row's rotary table, YaRN multiplier included),
    q, q_lat, ckv of one dtype (bf16, fp16 or fp32), cos / sin of one float dtype. Any strides (a last
    dim not contiguous is copied). Returns (q [T, h, C + R] = q_lat ‖ RoPE(q_pe), latent [T, C + R] =
    RMSNorm(c_kv) ‖ RoPE(k_pe)) in q's dtype. Raises ValueError on inconsistent shapes or dtypes.
    """
    floats = (torch.bfloat16, torch.float16, torch.float32)
    if q_lat.dim() != 3 or q.dim() != 3 or ckv.dim() != 2 or norm_w.dim() != 1 or cos.dim() != 2:
        raise ValueError(f"mla_project: q {tuple(q.shape)}, q_lat {tuple(q_lat.shape)}, ckv {tuple(ckv.shape)}, "
                         f"norm_w {tuple(norm_w.shape)}, cos {tuple(cos.shape)}: need q [T, h, N + R], q_lat "
                         "[T, h, C], ckv [T, C + R], norm_w [C], cos/sin [T, R/2]")
    T, h, C = q_lat.shape
    R = ckv.shape[-1] - C
    if (h < 1 or C < 1 or q.shape[:2] != (T, h) or q.shape[2] <= R or R <= 0 or R % 2 or ckv.shape[0] != T
            or norm_w.shape != (C,) or cos.shape != (T, R // 2) or sin.shape != cos.shape):
        raise ValueError(f"mla_project: q {tuple(q.shape)}, q_lat {tuple(q_lat.shape)}, ckv {tuple(ckv.shape)}, "
                         f"norm_w {tuple(norm_w.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: need q "
                         f"[T, h, N + R], q_lat [T, h, C], ckv [T, C + R] (R even), norm_w [C], cos/sin [T, R/2], "
                         "h, C, N >= 1")
    if len({t.dtype for t in (q, q_lat, ckv)}) != 1 or q.dtype not in floats or cos.dtype != sin.dtype \
            or cos.dtype not in floats or norm_w.dtype not in floats:
        raise ValueError(f"mla_project: q, q_lat, ckv must share one of {floats}, cos and sin one float dtype, "
                         f"norm_w a float dtype; got {q.dtype}, {q_lat.dtype}, {ckv.dtype}, cos {cos.dtype}, "
                         f"sin {sin.dtype}, norm_w {norm_w.dtype}")
    q, q_lat, ckv, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, q_lat, ckv, cos, sin))
    norm_w = norm_w.contiguous()
    out_q = torch.empty(T, h, C + R, device=q.device, dtype=q.dtype)
    latent = torch.empty(T, C + R, device=q.device, dtype=q.dtype)
    if T:
        _mla_project_kernel[(T,)](
            q, q_lat, ckv, norm_w, cos, sin, out_q, latent, eps,
            q.stride(0), q.stride(1), q_lat.stride(0), q_lat.stride(1), ckv.stride(0), cos.stride(0), sin.stride(0),
            out_q.stride(0), out_q.stride(1), latent.stride(0),
            H=h, N=q.shape[2] - R, C=C, HALF=R // 2, BLOCK_C=triton.next_power_of_2(C),
            BLOCK_HALF=triton.next_power_of_2(R // 2), HB=min(HEADS_PER_STEP, triton.next_power_of_2(h)),
            num_warps=4)
    return out_q, latent


def mla_project_reference(q, q_lat, ckv, norm_w, eps, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 reference of ``mla_project`` (no intermediate rounding)."""
    C = q_lat.shape[-1]
    R = ckv.shape[-1] - C
    c, s = cos.double(), sin.double()

    def rope(x):  # [T, ..., R] interleaved pairs
        shape = [x.shape[0]] + [1] * (x.dim() - 2) + [R // 2]
        a, b = x[..., 0::2].double(), x[..., 1::2].double()
        return torch.stack((a * c.view(shape) - b * s.view(shape), b * c.view(shape) + a * s.view(shape)), -1).flatten(-2)

    x = ckv[:, :C].double()
    norm = norm_w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (torch.cat([q_lat.double(), rope(q[..., q.shape[-1] - R:])], -1),
            torch.cat([norm, rope(ckv[:, C:])], -1))
