"""Row-invariant Llama forward for verify and decode on the GPU (Triton kernels, KV pool).

The same weights as ``modeling.llama.LlamaModel`` (q/k/v and gate/up fused into one matrix
each), run with ``specdec_kernels/``: every row's logits are bitwise independent of how many rows share
the forward and of the tree's shape, so a greedy tree verify picks exactly the tokens a one-row
decode would (shared DOMAIN notes §8). Inputs are device tensors only and the forward never
reads them on the host, so it can be captured in a CUDA graph (``modeling.graphs``).
Prefill keeps the eager ``LlamaModel`` path (autoregressive and speculative runs share it).
"""
from __future__ import annotations

import torch

from specdec_kernels.matmul import linear
from specdec_kernels.rmsnorm_rows import rmsnorm
from specdec_kernels.rope import inv_freq, rope_qkv
from specdec_kernels.swiglu import swiglu
from specdec_kernels.tree_attention import tree_attention
from modeling.kv_cache import KVPool, PagedKVPool
from modeling.llama import LlamaModel


class RowInvariantLlama:
    """Verify forward over a ``KVPool`` or a ``PagedKVPool`` (then every call passes the page
    tables, see ``__call__``).

    Args: model (a loaded ``LlamaModel`` on a CUDA device, or on CPU under TRITON_INTERPRET),
    pool (the pool its request caches live in), taps (ascending decoder-layer indices whose
    outputs form the context features).
    """

    def __init__(self, model: LlamaModel, pool: KVPool | PagedKVPool, taps: tuple[int, ...]):
        self.cfg, self.pool, self.taps = model.cfg, pool, tuple(taps)
        self.page_rows = getattr(pool, "page_rows", 128)
        body = model.model
        self.embed = body.embed_tokens.weight
        self.layers = []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                wqkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous(),
                wo=a.o_proj.weight, wgu=torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous(),
                wdown=m.down_proj.weight))
        self.norm = body.norm.weight
        self.lm_head = model.lm_head.weight
        self.freqs = inv_freq(model.cfg.head_dim, model.cfg.rope_theta, self.lm_head.device)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 ancestors: torch.Tensor, meta: torch.Tensor,
                 row_meta: torch.Tensor | None = None,
                 pages: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions, slots: [R] int64 (slot = pool row this row's K/V is written to);
        ancestors flat int64 with row stride meta[2] (see ``specdec_kernels.tree_attention``); meta [3]
        int64 = (base, L, W) of the request; row_meta [R, 2] int64 = (base, L) per row when the
        rows belong to several requests (replaces meta's base and L); pages (paged pool, with
        row_meta): the page tables, each row's base being its table's offset (slots are then
        already the paged rows). Returns (logits [R, V]
        float32, context features [R, len(taps)·H] or None)."""
        c = self.cfg
        h, g, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        x = self.embed[tokens]
        tapped = []
        for i, w in enumerate(self.layers):
            kp, vp = self.pool.k[i], self.pool.v[i]                           # [rows, g, d]
            qkv = linear(rmsnorm(x, w["ln1"], eps), w["wqkv"])                # [R, (h+2g)·d]
            q = rope_qkv(qkv, positions, self.freqs, slots, kp, vp, h, g)    # [R, h, d]; k, v → pool
            attn = tree_attention(q, kp, vp, positions, ancestors, meta, row_meta, pages, self.page_rows)  # [R, h·d]
            x = linear(attn, w["wo"], residual=x)
            gu = linear(rmsnorm(x, w["ln2"], eps), w["wgu"])                  # [R, 2·I]
            x = linear(swiglu(gu), w["wdown"], residual=x)
            if i in self.taps:
                tapped.append(x)
        logits = linear(rmsnorm(x, self.norm, eps), self.lm_head, out_dtype=torch.float32)
        return logits, (torch.cat(tapped, -1) if tapped else None)
