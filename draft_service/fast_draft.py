"""DFlash drafting on the GPU from CUDA graphs: context rows in a KV pool, the block forward
and the DDTree build captured per tree-budget bucket (DFlash §3 / DDTree; shared DOMAIN
notes §2, §3, §6).

Per round two graphs replay: ``append`` (the ≤ block_size context rows committed last round:
fc + hidden_norm, then every layer's k/v projection, k_norm and RoPE, written to the pool at
their absolute positions; padded rows go to the scratch row) and ``propose`` (the block
[bonus, MASK × (B−1)] at positions p…p+B−1 attending to context rows < p and bidirectionally
to itself — ``kernels.tree_attention`` with every block row's visibility limit at p+B−1 — then
the target LM head at slots 1…B−1 and the DDTree build at the bucket's budget). A tree built
at bucket budget b' ≥ b truncated to its first b nodes is the budget-b tree: nodes come in
best-first order and the top-b prefixes are prefix-closed. A longer context (the prompt's)
is appended eagerly by the same code. The drafter need not be row-invariant: it only steers
what is proposed, never what is emitted.
"""
from __future__ import annotations

import time

import torch

from draft_service.ddtree import build_chain, build_ddtree
from kernels.tree_attention import tree_attention
from modeling.dflash import DFlashDrafter
from modeling.kv_cache import KVCache, KVPool
from modeling.layers import apply_rope

BUDGET_BUCKETS = (4, 16, 64, 128, 256, 512)


class GraphedDrafter:
    """Args: drafter (on a CUDA device), embed / lm_head [V, H] (the target's, same device and
    dtype), pool_rows (context rows of all live requests together), max_budget, graphs (False:
    the same code eagerly, for tests and ``--no-graphs``)."""

    def __init__(self, drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor,
                 pool_rows: int, max_budget: int = 512, graphs: bool = True):
        c = self.cfg = drafter.config
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        dev, dt, B = embed.device, embed.dtype, c.block_size
        self.device, self.B = dev, B
        self.pool = KVPool(c.num_hidden_layers, pool_rows, c.num_key_value_heads, c.head_dim, dev, dt)
        self.ctx: dict[str, KVCache] = {}
        width = len(c.target_layer_ids) * c.hidden_size
        # static inputs
        self.feats = torch.zeros(B, width, device=dev, dtype=dt)
        self.feat_pos = torch.zeros(B, dtype=torch.int64, device=dev)
        self.feat_slots = torch.zeros(B, dtype=torch.int64, device=dev)
        self.meta = torch.zeros(2, dtype=torch.int64, device=dev)  # (base, p)
        self.bonus = torch.zeros(1, dtype=torch.int64, device=dev)
        self.block_anc = torch.arange(B, dtype=torch.int32, device=dev).expand(B, B).contiguous()
        self.buckets = [b for b in BUDGET_BUCKETS if b < max_budget] + [max_budget]
        self.graphs: dict[object, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.capture_seconds = 0.0
        if graphs:
            self.capture()

    # -- the captured bodies ---------------------------------------------------------------
    def _append_body(self, feats, positions, slots) -> None:
        ctx = self.drafter.hidden_norm(self.drafter.fc(feats))
        cos, sin = self.drafter.rope(positions, ctx.dtype)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.kv(ctx, cos, sin)
            self.pool.k[i].index_copy_(0, slots, k)
            self.pool.v[i].index_copy_(0, slots, v)

    def _propose_body(self, mode: str, budget: int):
        c, B = self.cfg, self.B
        p = self.meta[1]
        offs = torch.arange(B, device=self.device)
        positions, slots = p + offs, self.meta[0] + p + offs
        vis = offs * 0 + (p + B - 1)  # bidirectional block: every row sees all B block rows
        block = torch.where(offs == 0, self.bonus, c.mask_token_id)
        x = self.embed[block]
        cos, sin = self.drafter.rope(positions, x.dtype)
        for i, layer in enumerate(self.drafter.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(a.q_norm(a.q_proj(h).view(B, a.h, a.d)), cos, sin)
            k, v = a.kv(h, cos, sin)
            self.pool.k[i].index_copy_(0, slots, k)
            self.pool.v[i].index_copy_(0, slots, v)
            x = x + a.o_proj(tree_attention(q.contiguous(), self.pool.k[i], self.pool.v[i], vis,
                                            self.block_anc, self.meta))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = (self.drafter.norm(x)[1:] @ self.lm_head.T).float()[None]  # [1, B-1, V]
        tree = build_chain(logits, self.bonus)[0] if mode == "chain" else build_ddtree(logits, self.bonus, budget)[0]
        return torch.stack([tree.tokens, tree.parents])  # [2, N+1]

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        self.meta.copy_(torch.tensor([0, 1]))  # scratch row 0, p = 1: harmless warm-up writes
        keys = [("tree", b) for b in reversed(self.buckets)] + [("chain", 0), ("append", 0)]
        for key in keys:
            fn = (lambda: self._append_body(self.feats, self.feat_pos, self.feat_slots)) if key[0] == "append" \
                else (lambda key=key: self._propose_body(*key))
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=mempool):
                out = fn()
            self.graphs[key] = (g, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0

    # -- per-request state -------------------------------------------------------------------
    def context(self, request_id: str) -> KVCache | None:
        return self.ctx.get(request_id)

    def new_context(self, request_id: str, rows: int) -> KVCache:
        self.ctx[request_id] = cache = self.pool.allocate(max(rows, 64))
        return cache

    def _ensure(self, cache: KVCache, rows: int, request_id: str) -> KVCache:
        """Grow (move to a range twice as large) when ``rows`` exceed the capacity."""
        if rows <= cache.capacity:
            return cache
        new = self.pool.allocate(max(rows, 2 * cache.capacity))
        new.k[:, :cache.length] = cache.k[:, :cache.length]
        new.v[:, :cache.length] = cache.v[:, :cache.length]
        new.length = cache.length
        self.pool.free(cache)
        self.ctx[request_id] = new
        return new

    @torch.inference_mode()
    def draft(self, request_id: str, features: torch.Tensor, bonus: int, mode: str, budget: int
              ) -> tuple[list[int], list[int]]:
        """Append features [n, taps·H] at positions length…length+n−1 of the request's context
        (created by ``new_context``) and propose a tree rooted at ``bonus``. Returns (tokens,
        parents) flat, index 0 = root. Raises MemoryError when the pool has no room."""
        cache = self.ctx[request_id]
        n, B = features.shape[0], self.B
        p = cache.length + n
        cache = self._ensure(cache, p + B, request_id)
        if n:
            pos = torch.arange(cache.length, p, device=self.device)
            slots = cache.base + pos
            feats = features.to(self.device, self.embed.dtype, non_blocking=True)
            if n <= B and self.graphs:
                self.feats[:n].copy_(feats)
                self.feat_pos[:n].copy_(pos)
                self.feat_slots[:n].copy_(slots)
                self.feat_slots[n:].zero_()  # padded rows → scratch row
                self.graphs[("append", 0)][0].replay()
            else:
                self._append_body(feats, pos, slots)
            cache.length = p
        self.meta.copy_(torch.tensor([cache.base, p]), non_blocking=True)
        self.bonus.fill_(bonus)
        if mode == "chain":
            key = ("chain", 0)
        else:
            key = ("tree", next(b for b in self.buckets if b >= budget))
        if self.graphs:
            g, out = self.graphs[key]
            g.replay()
        else:
            out = self._propose_body(*key)
        tokens, parents = out.tolist()  # the one device → host copy of the round
        keep = budget + 1 if mode == "tree" else len(tokens)
        return tokens[:keep], parents[:keep]

    def release(self, request_id: str) -> bool:
        cache = self.ctx.pop(request_id, None)
        if cache is not None:
            self.pool.free(cache)
        return cache is not None
