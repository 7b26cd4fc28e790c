"""Batched target forwards built from ``modeling.llama`` modules (the service forward is
single-sequence): padded-batch features for training and a padded-batch KV decoder for
regenerating responses (self-distillation data). Same math as ``LlamaModel.forward``.

Shapes: b = rows, T = new tokens, S = key rows, H = hidden, h/g = q/kv heads, d = head dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from modeling.layers import apply_rope, rope_cos_sin
from modeling.llama import LlamaModel


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope for x [b, T, heads, d] and cos/sin [b, T, d]."""
    b, T = x.shape[:2]
    return apply_rope(x.reshape(b * T, *x.shape[2:]), cos.reshape(b * T, -1), sin.reshape(b * T, -1)).view(x.shape)


def _layer(model: LlamaModel, i: int, x, cos, sin, mask, kv=None, start=0):
    """Decoder layer i on x [b, T, H]. mask: [b, 1, T, S] bool or "causal". kv: optional
    (k, v) caches [b, g, S_max, d]; new rows are written at [start, start + T)."""
    layer = model.model.layers[i]
    a = layer.self_attn
    b, T, _ = x.shape
    hn = layer.input_layernorm(x)
    q = _rope(a.q_proj(hn).view(b, T, a.h, a.d), cos, sin).transpose(1, 2)
    k = _rope(a.k_proj(hn).view(b, T, a.g, a.d), cos, sin).transpose(1, 2)
    v = a.v_proj(hn).view(b, T, a.g, a.d).transpose(1, 2)
    if kv is not None:
        kv[0][:, :, start:start + T] = k
        kv[1][:, :, start:start + T] = v
        k, v = kv[0][:, :, :start + T], kv[1][:, :, :start + T]
    if isinstance(mask, str):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    x = x + a.o_proj(out.transpose(1, 2).reshape(b, T, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


@torch.no_grad()
def target_features(model: LlamaModel, tokens: torch.Tensor, taps: tuple[int, ...]) -> torch.Tensor:
    """Tapped features [b, L, len(taps)·H] (residual stream after each tapped layer, as
    ``LlamaModel.forward``) of right-padded tokens [b, L] int64 at positions 0…L−1 (causal, so
    padding after a row's end never reaches its real tokens)."""
    b, L = tokens.shape
    x = model.model.embed_tokens(tokens)
    pos = torch.arange(L, device=tokens.device)
    cos, sin = rope_cos_sin(pos, model.cfg.head_dim, model.cfg.rope_theta, x.dtype)
    cos, sin = cos.expand(b, L, -1), sin.expand(b, L, -1)
    out = []
    for i in range(max(taps) + 1):
        x = _layer(model, i, x, cos, sin, "causal")
        if i in taps:
            out.append(x)
    return torch.cat(out, -1)


@torch.no_grad()
def generate(model: LlamaModel, prompts: list[list[int]], max_new_tokens: int, temperatures: torch.Tensor,
             eos_ids: tuple[int, ...], generator: torch.Generator | None = None) -> list[list[int]]:
    """Decode a batch: prompts (token lists) left-padded, per-row positions from 0, a padded
    batch KV [b, g, P + max_new, d] per layer. Row r is greedy if temperatures[r] == 0, else
    sampled at that temperature (Gumbel-max). Returns each row's new tokens up to and
    including its first EOS (or max_new_tokens tokens)."""
    dev = model.lm_head.weight.device
    dt = model.lm_head.weight.dtype
    cfg = model.cfg
    b, P = len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([P - len(p) for p in prompts], device=dev)
    tokens = torch.zeros(b, P, dtype=torch.int64, device=dev)
    for r, p in enumerate(prompts):
        tokens[r, P - len(p):] = torch.tensor(p, device=dev)
    S = P + max_new_tokens
    valid = torch.arange(S, device=dev)[None, :] >= pad[:, None]  # [b, S] key rows that exist
    kvs = [(torch.zeros(b, cfg.num_key_value_heads, S, cfg.head_dim, device=dev, dtype=dt),
            torch.zeros(b, cfg.num_key_value_heads, S, cfg.head_dim, device=dev, dtype=dt))
           for _ in range(cfg.num_hidden_layers)]
    temps = temperatures.to(dev, torch.float32)
    eos = torch.tensor(eos_ids, device=dev)
    out = torch.zeros(b, max_new_tokens, dtype=torch.int64, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    cur, start = tokens, 0
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    for t in range(max_new_tokens):
        T = cur.shape[1]
        pos = (torch.arange(start, start + T, device=dev)[None, :] - pad[:, None]).clamp(min=0)
        cos, sin = rope_cos_sin(pos.reshape(-1), cfg.head_dim, cfg.rope_theta, dt)
        cos, sin = cos.view(b, T, -1), sin.view(b, T, -1)
        keys = valid[:, None, None, :start + T]
        # at prefill a pad row sees itself too, so no row is all-masked (NaN-free pad K/V)
        mask = (keys | torch.eye(P, dtype=torch.bool, device=dev)) & causal if t == 0 else keys
        x = model.model.embed_tokens(cur)
        for i in range(cfg.num_hidden_layers):
            x = _layer(model, i, x, cos, sin, mask, kvs[i], start)
        logits = model.logits(model.model.norm(x[:, -1]))  # [b, V] float32
        gumbel = -torch.empty_like(logits).exponential_(generator=generator).log()
        sampled = (logits / temps.clamp(min=1e-5)[:, None] + gumbel).argmax(-1)
        nxt = torch.where(temps > 0, sampled, logits.argmax(-1))
        out[:, t] = torch.where(done, eos[0], nxt)
        done |= torch.isin(nxt, eos)
        start += T
        cur = nxt[:, None]
        if t % 16 == 15 and bool(done.all()):
            break
    res = []
    for row in out.tolist():
        n = next((i + 1 for i, x in enumerate(row) if x in eos_ids), len(row))
        res.append(row[:n])
    return res
