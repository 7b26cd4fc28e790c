"""Building blocks shared by the target (Llama) and the drafter (Qwen3-style DFlash layers).

Shapes: T = query rows, S = key rows, H = hidden size, h = heads, g = KV heads, d = head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019) over the last dimension, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    """Llama MLP: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """Rotary tables for absolute positions [T] (int64) → cos, sin [T, d] (half-split layout,
    as HF Llama: RoFormer, Su et al. 2021)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                              device=positions.device).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, d] with cos/sin [T, d] (half-split pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention. q [T, h, d], k/v [S, g, d], mask [T, S] bool (True = visible)
    or None (all visible). Returns [T, h*d]. Scale 1/sqrt(d).

    Small problems (decode and tree verify) use grouped matmuls directly: on CPU they are
    several times faster than the fused kernel's per-call overhead. Large ones (prefill) use
    ``scaled_dot_product_attention`` to bound memory."""
    T, h, d = q.shape
    S, g = k.shape[0], k.shape[1]
    if T * S * h > (1 << 22):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=h != g)
        return out.transpose(0, 1).reshape(T, h * d)
    r = h // g
    qg = q.view(T, g, r, d).permute(1, 0, 2, 3).reshape(g, T * r, d)        # [g, T*r, d]
    scores = (qg @ k.permute(1, 2, 0)).float() * d ** -0.5                  # [g, T*r, S]
    if mask is not None:
        scores = scores.view(g, T, r, S).masked_fill(~mask[None, :, None, :], float("-inf")).view(g, T * r, S)
    out = scores.softmax(-1).to(v.dtype) @ v.transpose(0, 1)                # [g, T*r, d]
    return out.view(g, T, r, d).permute(1, 0, 2, 3).reshape(T, h * d)
