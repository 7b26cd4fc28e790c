"""Llama-family target forward with per-request KV, tree (visibility) masks and tapped layers.

Follows the HF Llama layout (Touvron et al. 2023): pre-norm decoder layers with grouped-query
attention, half-split RoPE and a SwiGLU MLP; the LM head may be tied to the embedding.
"""
from __future__ import annotations

import torch
from torch import nn

from modeling.config import LlamaConfig
from modeling.kv_cache import KVCache
from modeling.layers import RMSNorm, SwiGLU, apply_rope, attend, rope_cos_sin


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.h, self.g, self.d = h, g, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, g * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, g * d, bias=False)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache: KVCache, layer: int, mask):
        T = x.shape[0]
        q = apply_rope(self.q_proj(x).view(T, self.h, self.d), cos, sin)
        k = apply_rope(self.k_proj(x).view(T, self.g, self.d), cos, sin)
        v = self.v_proj(x).view(T, self.g, self.d)
        k_all, v_all = cache.write(layer, k, v)
        return self.o_proj(attend(q, k_all, v_all, mask))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, cache, layer, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    """Target model. Parameter names match HF ``LlamaForCausalLM`` state dicts."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_state_dict(cls, cfg: LlamaConfig, state: dict, device="cpu", dtype=torch.float32) -> "LlamaModel":
        """Build, load ``state`` (HF names; missing lm_head allowed when tied) and move."""
        model = cls(cfg)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"weights do not match the config: missing={missing[:5]} unexpected={unexpected[:5]}")
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def new_cache(self, capacity: int) -> KVCache:
        p = self.lm_head.weight
        return KVCache(self.cfg.num_hidden_layers, capacity, self.cfg.num_key_value_heads,
                       self.cfg.head_dim, p.device, p.dtype)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                mask: torch.Tensor, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run T new tokens against the committed KV and write their K/V (uncommitted).

        tokens, positions: [T] int64; mask: [T, cache.length + T] bool (True = visible);
        taps: decoder-layer indices whose output (residual stream after layer k) is returned.
        Returns (final-normed hidden [T, H], context features [T, len(taps)*H] or None).
        """
        if list(taps) != sorted(set(taps)):
            raise ValueError(f"taps must be ascending and distinct, got {taps}")
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        tapped = []
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, i, mask)
            if i in taps:
                tapped.append(x)
        features = torch.cat(tapped, -1) if taps else None
        return self.model.norm(x), features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] → [T, V] float32."""
        return self.lm_head(hidden).float()


def causal_mask(prefix: int, T: int, device=None) -> torch.Tensor:
    """[T, prefix + T] bool: all prefix rows plus causal attention among the T new rows."""
    new = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(T, prefix, dtype=torch.bool, device=device), new], 1)


def tree_mask(prefix: int, visibility: torch.Tensor) -> torch.Tensor:
    """[N+1, prefix + N+1] bool: all prefix rows plus the tree's visibility (ancestor) mask."""
    n = visibility.shape[0]
    return torch.cat([torch.ones(n, prefix, dtype=torch.bool, device=visibility.device), visibility], 1)
