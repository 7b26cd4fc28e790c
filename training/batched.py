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
def target_features(model: LlamaModel, tokens: torch.Tensor, taps: tuple[int, ...], final: bool = False):
    """Tapped features [b, L, len(taps)·H] (residual stream after each tapped layer, as
    ``LlamaModel.forward``) of right-padded tokens [b, L] int64 at positions 0…L−1 (causal, so
    padding after a row's end never reaches its real tokens). With ``final``, also the
    final-normed hidden states [b, L, H] (all layers run): (features, final)."""
    b, L = tokens.shape
    x = model.model.embed_tokens(tokens)
    pos = torch.arange(L, device=tokens.device)
    cos, sin = rope_cos_sin(pos, model.cfg.head_dim, model.cfg.rope_theta, x.dtype)
    cos, sin = cos.expand(b, L, -1), sin.expand(b, L, -1)
    out = []
    for i in range(model.cfg.num_hidden_layers if final else max(taps) + 1):
        x = _layer(model, i, x, cos, sin, "causal")
        if i in taps:
            out.append(x)
    feats = torch.cat(out, -1)
    return (feats, model.model.norm(x)) if final else feats


def _decode_attention(model: LlamaModel, i: int, x, cos, sin, kv, start, valid):
    """Decode step of layer i's attention for x [b, 1, H]: GQA as grouped matmuls (query heads
    of one KV head folded into rows, so K/V are never expanded), K/V rows written at ``start``,
    keys [0, start] visible where ``valid`` [b, S] is True. Returns x after attention."""
    a = model.model.layers[i].self_attn
    b = x.shape[0]
    hn = model.model.layers[i].input_layernorm(x)
    q = _rope(a.q_proj(hn).view(b, 1, a.h, a.d), cos, sin).view(b, a.g, a.h // a.g, a.d)
    kv[0][:, :, start] = _rope(a.k_proj(hn).view(b, 1, a.g, a.d), cos, sin)[:, 0]
    kv[1][:, :, start] = a.v_proj(hn).view(b, a.g, a.d)
    k, v = kv[0][:, :, :start + 1], kv[1][:, :, :start + 1]
    s = (q @ k.transpose(-1, -2)).float() * a.d ** -0.5  # [b, g, reps, S]
    s = s.masked_fill(~valid[:, None, None, :start + 1], float("-inf"))
    out = torch.softmax(s, -1).to(v.dtype) @ v  # [b, g, reps, d]
    return x + a.o_proj(out.reshape(b, 1, a.h * a.d))


@torch.no_grad()
def generate(model: LlamaModel, prompts: list[list[int]], max_new_tokens: int, temperatures: torch.Tensor,
             eos_ids: tuple[int, ...], generator: torch.Generator | None = None, prefill_rows: int = 512,
             compact_every: int = 32) -> list[list[int]]:
    """Decode a batch: prompts (token lists) left-padded, per-row positions from 0, a padded
    batch KV [b, g, P + max_new, d] per layer. Row r is greedy if temperatures[r] == 0, else
    sampled at that temperature (Gumbel-max). Prefill runs ``prefill_rows`` rows at a time
    (bounds the attention temporaries); every ``compact_every`` steps finished rows are dropped
    from the batch once a quarter of it is done. Returns each row's new tokens up to and
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
    rows = torch.arange(b, device=dev)  # original row of each live batch row
    results: list[list[int] | None] = [None] * b
    # prefill, row chunks; a pad row sees itself too, so no row is all-masked (NaN-free pad K/V)
    causal = torch.ones(P, P, dtype=torch.bool, device=dev).tril()
    last = torch.empty(b, cfg.hidden_size, device=dev, dtype=dt)
    for r0 in range(0, b, prefill_rows):
        r1 = min(b, r0 + prefill_rows)
        pos = (torch.arange(P, device=dev)[None, :] - pad[r0:r1, None]).clamp(min=0)
        cos, sin = rope_cos_sin(pos.reshape(-1), cfg.head_dim, cfg.rope_theta, dt)
        cos, sin = cos.view(r1 - r0, P, -1), sin.view(r1 - r0, P, -1)
        mask = (valid[r0:r1, None, None, :P] | torch.eye(P, dtype=torch.bool, device=dev)) & causal
        x = model.model.embed_tokens(tokens[r0:r1])
        for i in range(cfg.num_hidden_layers):
            x = _layer(model, i, x, cos, sin, mask, (kvs[i][0][r0:r1], kvs[i][1][r0:r1]), 0)
        last[r0:r1] = x[:, -1]
    x = last[:, None]
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    for t in range(max_new_tokens):
        start = P + t - 1  # cache row of x's token (the last prompt token at t = 0: already cached)
        if t > 0:
            pos = (start - pad).clamp(min=0)[:, None]
            cos, sin = rope_cos_sin(pos.reshape(-1), cfg.head_dim, cfg.rope_theta, dt)
            cos, sin = cos.view(-1, 1, cos.shape[-1]), sin.view(-1, 1, sin.shape[-1])
            for i in range(cfg.num_hidden_layers):
                layer = model.model.layers[i]
                x = _decode_attention(model, i, x, cos, sin, kvs[i], start, valid)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = model.logits(model.model.norm(x[:, -1]))  # [b, V] float32
        gumbel = -torch.empty_like(logits).exponential_(generator=generator).log()
        sampled = (logits / temps.clamp(min=1e-5)[:, None] + gumbel).argmax(-1)
        nxt = torch.where(temps > 0, sampled, logits.argmax(-1))
        out[:, t] = torch.where(done, eos[0], nxt)
        done |= torch.isin(nxt, eos)
        x = model.model.embed_tokens(nxt)[:, None]
        if t % compact_every == compact_every - 1 or t == max_new_tokens - 1:
            n_done = int(done.sum())
            if n_done == len(done) or t == max_new_tokens - 1:
                break
            if n_done * 4 >= len(done):  # drop finished rows from every batch tensor
                for r, row in zip(rows[done].tolist(), out[done].tolist()):
                    results[r] = row
                keep = ~done
                rows, pad, valid, temps, out, x = rows[keep], pad[keep], valid[keep], temps[keep], out[keep], x[keep]
                for i, (k, v) in enumerate(kvs):  # layer by layer: peak memory + one layer, not 2x
                    kvs[i] = (k[keep], v[keep])
                done = done[keep]
    for r, row in zip(rows.tolist(), out.tolist()):
        results[r] = row
    res = []
    for row in results:
        n = next((i + 1 for i, x in enumerate(row) if x in eos_ids), len(row))
        res.append(row[:n])
    return res
