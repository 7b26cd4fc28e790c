"""Fused rotary embedding + KV write for one fused QKV projection (row-invariant), with an
optional per-head RMSNorm of q and k first (Qwen3-style layers, as the DFlash drafter has).

One program per row: rotates the row's query heads and key heads (half-split pairs, as HF
Llama / RoFormer) at the row's absolute position, writes the query to its output, and writes
the rotated key and the value to the KV pool at the row's slot — the ~13 small torch kernels of
``apply_rope`` + copies become one launch. Angles are position · inv_freq in float32; the
result is rounded once to the activation dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_qkv_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, eps,
                     s_qkv, s_q, s_kv_row, s_kv_head,
                     H: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     HEAD_NORM: tl.constexpr):
    r = tl.program_id(0)
    head = tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + r).to(tl.float32)
    slot = tl.load(slot_ptr + r)
    angle = pos * tl.load(inv_freq_ptr + j)
    c = tl.cos(angle)[None, :]
    s = tl.sin(angle)[None, :]
    live = head < H + 2 * G
    base = qkv_ptr + r * s_qkv + head[:, None] * (2 * HALF)
    x1 = tl.load(base + j[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + j[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    rot = (head < H + G)[:, None]
    if HEAD_NORM:  # per-head RMSNorm of q and k (Qwen3 q_norm / k_norm), rounded like the module
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        dt = qkv_ptr.dtype.element_ty
        is_q_row = (head < H)[:, None]
        w1 = tl.where(is_q_row, tl.load(qn_ptr + j)[None, :], tl.load(kn_ptr + j)[None, :]).to(tl.float32)
        w2 = tl.where(is_q_row, tl.load(qn_ptr + HALF + j)[None, :], tl.load(kn_ptr + HALF + j)[None, :]).to(tl.float32)
        x1 = tl.where(rot, (x1 * rstd[:, None]).to(dt).to(tl.float32) * w1, x1)
        x2 = tl.where(rot, (x2 * rstd[:, None]).to(dt).to(tl.float32) * w2, x2)
    o1 = tl.where(rot, x1 * c - x2 * s, x1)
    o2 = tl.where(rot, x2 * c + x1 * s, x2)
    is_q = (head < H)[:, None]
    qo = q_ptr + r * s_q + head[:, None] * (2 * HALF)
    tl.store(qo + j[None, :], o1.to(q_ptr.dtype.element_ty), mask=is_q)
    tl.store(qo + HALF + j[None, :], o2.to(q_ptr.dtype.element_ty), mask=is_q)
    is_k = ((head >= H) & (head < H + G))[:, None]
    ko = k_ptr + slot * s_kv_row + (head[:, None] - H) * s_kv_head
    tl.store(ko + j[None, :], o1.to(k_ptr.dtype.element_ty), mask=is_k)
    tl.store(ko + HALF + j[None, :], o2.to(k_ptr.dtype.element_ty), mask=is_k)
    is_v = ((head >= H + G) & live)[:, None]
    vo = v_ptr + slot * s_kv_row + (head[:, None] - H - G) * s_kv_head
    tl.store(vo + j[None, :], o1.to(v_ptr.dtype.element_ty), mask=is_v)
    tl.store(vo + HALF + j[None, :], o2.to(v_ptr.dtype.element_ty), mask=is_v)


def inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """[head_dim/2] float32 rotary frequencies θ^(−2i/d), as HF Llama computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope_qkv(qkv: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, slots: torch.Tensor,
             k_pool: torch.Tensor, v_pool: torch.Tensor, heads: int, kv_heads: int,
             q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
             eps: float = 1e-6) -> torch.Tensor:
    """qkv [R, (heads + 2·kv_heads)·d] (q heads, then k heads, then v heads; heads may be 0);
    positions, slots [R] int64; freqs [d/2] float32 (``inv_freq``); k_pool/v_pool [rows,
    kv_heads, d] (one layer); q_norm/k_norm [d] (both or neither): per-head RMSNorm before
    RoPE, as Qwen3 / DFlash layers. Writes rotated k and v to pool row slots[r]; returns
    rotated q [R, heads, d]."""
    R = qkv.shape[0]
    d = k_pool.shape[-1]
    q = torch.empty(R, heads, d, device=qkv.device, dtype=qkv.dtype)
    norm = q_norm is not None
    _rope_qkv_kernel[(R,)](qkv, positions, freqs, slots, q, k_pool, v_pool, q_norm if norm else freqs,
                           k_norm if norm else freqs, eps, qkv.stride(0), max(q.stride(0), 1),
                           k_pool.stride(0), k_pool.stride(1), H=heads, G=kv_heads, HALF=d // 2,
                           BLOCK_H=triton.next_power_of_2(heads + 2 * kv_heads), HEAD_NORM=norm, num_warps=4)
    return q


def rope_qkv_reference(qkv, positions, freqs, slots, k_pool, v_pool, heads, kv_heads, q_norm=None, k_norm=None,
                       eps=1e-6):
    """float64 reference: returns (q [R, h, d], k [R, g, d], v [R, g, d]) instead of writing."""
    R = qkv.shape[0]
    d = k_pool.shape[-1]
    x = qkv.double().view(R, heads + 2 * kv_heads, d).clone()
    if q_norm is not None:
        rms = lambda t, w: w.double() * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
        x[:, :heads] = rms(x[:, :heads], q_norm)
        x[:, heads:heads + kv_heads] = rms(x[:, heads:heads + kv_heads], k_norm)
    ang = positions.double()[:, None] * freqs.double()[None, :]
    c, s = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = lambda t: t * c + torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1) * s
    return rot(x[:, :heads]), rot(x[:, heads:heads + kv_heads]), x[:, heads + kv_heads:]
