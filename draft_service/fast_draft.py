"""DFlash drafting on the GPU from CUDA graphs: context rows in a KV pool, the block forward
and the DDTree build captured per tree-budget bucket (DFlash §3 / DDTree; shared DOMAIN
notes §2, §3, §6).

Per round one graph replays: ``append`` (the ≤ block_size context rows committed last round:
fc, then per layer hidden_norm + k/v projection, k_norm and RoPE, written to the pool at their
absolute positions; padded rows go to the scratch row) followed by ``propose`` (the block
[bonus, MASK × (B−1)] at positions p…p+B−1 attending to context rows < p and bidirectionally
to itself — ``kernels.tree_attention`` with every block row's visibility limit at p+B−1 — then
the target LM head at slots 1…B−1 and the DDTree build at the bucket's budget: the top-K
log-probs per depth (``kernels.topk_logprobs``, two launches, for K ≤ 64; log_softmax +
``torch.topk`` above), then the one-launch best-first kernel ``kernels.ddtree_build``). Both use the target
fast path's kernels (row RMSNorm, fixed-tile matmuls, q/k-norm + RoPE + KV write, SwiGLU).
Inputs (the new rows' positions, slots and features, the block's tokens, positions, slots and
visibility, meta, bonus, budget) reach the device in one copy from a pinned buffer; the tree
comes back in one copy. A tree built at bucket budget b' ≥ b truncated to its first b nodes is
the budget-b tree: nodes come in best-first order and the top-b prefixes are prefix-closed. A
longer context (the prompt's) is appended eagerly by the same code, then the block alone
replays. The drafter need not be row-invariant: it only steers what is proposed, never what is
emitted.
"""
from __future__ import annotations

import os
import time

import torch

from draft_service.ddtree import _log_probs, build_chain, build_ddtree
from kernels.ddtree_build import build_ddtree_topk
from kernels.matmul import linear
from kernels.rmsnorm_rows import rmsnorm
from kernels.rope import inv_freq, rope_qkv
from kernels.swiglu import swiglu
from kernels.topk_logprobs import MAX_K, topk_log_probs
from kernels.tree_attention import tree_attention
from modeling.dflash import DFlashDrafter
from modeling.kv_cache import KVCache, KVPool

BUDGET_BUCKETS = (4, 16, 64, 128, 256, 512)


# SPECDEC_FUSED_TOPK=0: log_softmax + torch.topk on CUDA too (the session-4 first cut; to
# compare, or to fall back should the fused top-K misbehave on a GPU)
FUSED_TOPK = os.environ.get("SPECDEC_FUSED_TOPK", "1") != "0"


def ranked_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] float → (top-k log-probs [..., k] float32 descending, ids [..., k] int64):
    on CUDA the fused kernel for k ≤ ``kernels.topk_logprobs.MAX_K``, else (and on the CPU,
    where Triton's interpreter sorts slowly) log_softmax + torch.topk."""
    if FUSED_TOPK and logits.is_cuda and k <= MAX_K:
        return topk_log_probs(logits, k)
    return _log_probs(logits).topk(k, dim=-1)


class GraphedDrafter:
    """Args: drafter (on a CUDA device), embed / lm_head [V, H] (the target's, same device and
    dtype), pool_rows (context rows of all live requests together), max_tree_budget, graphs (False:
    the same code eagerly, for tests and ``--no-graphs``), fused_tree (build the tree with the
    one-launch kernel ``kernels.ddtree_build`` after ``ranked_log_probs``; default on CUDA; False: the
    batched torch builder of ``draft_service.ddtree``, ~60 small launches)."""

    def __init__(self, drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor,
                 pool_rows: int, max_tree_budget: int = 512, graphs: bool = True,
                 fused_tree: bool | None = None):
        c = self.cfg = drafter.config
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        dev, dt, B = embed.device, embed.dtype, c.block_size
        self.device, self.B = dev, B
        self.pool = KVPool(c.num_hidden_layers, pool_rows, c.num_key_value_heads, c.head_dim, dev, dt)
        self.ctx: dict[str, KVCache] = {}
        width = len(c.target_layer_ids) * c.hidden_size
        self.fused_tree = dev.type == "cuda" if fused_tree is None else fused_tree
        # static inputs in one byte buffer, filled from a pinned host mirror with one copy per
        # round: int64 [positions(B) | slots(B) | meta(3) | bonus | budget | block tokens(B) |
        # block positions(B) | block slots(B) | block visibility limits(B)], then the ≤ B new
        # context rows' features [B, width] in the model dtype
        n_ints = 6 * B + 5
        size = 8 * n_ints + B * width * embed.element_size()
        self.buf = torch.zeros(size, dtype=torch.uint8, device=dev)
        self.buf_host = torch.zeros(size, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        self.ints, self.ints_host = (b[:8 * n_ints].view(torch.int64) for b in (self.buf, self.buf_host))
        self.ints_np = self.ints_host.numpy()
        self.feats, self.feats_host = (b[8 * n_ints:].view(dt).view(B, width) for b in (self.buf, self.buf_host))
        self.feat_pos, self.feat_slots = self.ints[:B], self.ints[B:2 * B]
        self.meta = self.ints[2 * B:2 * B + 3]  # (base, p, B): tree_attention's meta
        self.bonus = self.ints[2 * B + 3:2 * B + 4]
        self.budget = self.ints[2 * B + 4:2 * B + 5]  # nodes to build (≤ the bucket's capacity)
        # the block [bonus, MASK × (B−1)] at p…p+B−1, each row seeing all B block rows
        self.blk_tok, self.blk_pos, self.blk_slots, self.blk_vis = self.ints[2 * B + 5:].view(4, B)
        self.block_anc = torch.arange(B, dtype=torch.int32, device=dev).repeat(B)  # row stride B
        self.buckets = [b for b in BUDGET_BUCKETS if b < max_tree_budget] + [max_tree_budget]
        cat = lambda *ws: torch.cat([w.weight for w in ws]).contiguous()
        self.layers = [dict(ln1=l.input_layernorm.weight, ln2=l.post_attention_layernorm.weight,
                            q_norm=l.self_attn.q_norm.weight, k_norm=l.self_attn.k_norm.weight,
                            wqkv=cat(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj),
                            wkv=cat(l.self_attn.k_proj, l.self_attn.v_proj), wo=l.self_attn.o_proj.weight,
                            wgu=cat(l.mlp.gate_proj, l.mlp.up_proj), wdown=l.mlp.down_proj.weight)
                       for l in drafter.layers]
        self.freqs = inv_freq(c.head_dim, c.rope_theta, dev)
        # the proposed tree [2, capacity+1] (tokens, parents) comes back through a pinned buffer
        self.out_host = torch.zeros(2 * (max(self.buckets[-1], B - 1) + 1), dtype=torch.int64,
                                    pin_memory=dev.type == "cuda")
        self.graphs: dict[object, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.capture_seconds = 0.0
        if graphs:
            self.capture()

    # -- the captured bodies ---------------------------------------------------------------
    def _append_body(self, feats, positions, slots) -> None:
        """Context rows: fc and hidden_norm once, then per layer the k/v projection, k_norm +
        RoPE, written to the pool."""
        c, eps = self.cfg, self.cfg.rms_norm_eps
        ctx = rmsnorm(linear(feats, self.drafter.fc.weight), self.drafter.hidden_norm.weight, eps)  # [n, H]
        for i, w in enumerate(self.layers):
            kv = linear(ctx, w["wkv"])
            rope_qkv(kv, positions, self.freqs, slots, self.pool.k[i], self.pool.v[i], 0, c.num_key_value_heads,
                     w["q_norm"], w["k_norm"], eps)

    def _propose_body(self, mode: str, budget: int):
        c, B, eps = self.cfg, self.B, self.cfg.rms_norm_eps
        h, g = c.num_attention_heads, c.num_key_value_heads
        positions, slots, vis = self.blk_pos, self.blk_slots, self.blk_vis
        x = self.embed[self.blk_tok]  # [bonus, MASK…]
        for i, w in enumerate(self.layers):
            kp, vp = self.pool.k[i], self.pool.v[i]
            qkv = linear(rmsnorm(x, w["ln1"], eps), w["wqkv"])
            q = rope_qkv(qkv, positions, self.freqs, slots, kp, vp, h, g, w["q_norm"], w["k_norm"], eps)
            x = linear(tree_attention(q, kp, vp, vis, self.block_anc, self.meta), w["wo"], residual=x)
            x = linear(swiglu(linear(rmsnorm(x, w["ln2"], eps), w["wgu"])), w["wdown"], residual=x)
        logits = linear(rmsnorm(x[1:], self.drafter.norm.weight, eps), self.lm_head,
                        out_dtype=torch.float32)[None]  # [1, B-1, V]: same-position predictions at depths 1…B−1
        if self.fused_tree:  # top-K, then one launch; a chain is the tree with K = 1, budget B−1
            cap = B - 1 if mode == "chain" else budget
            top_lp, top_ids = ranked_log_probs(logits, 1 if mode == "chain" else min(budget, c.vocab_size))
            return build_ddtree_topk(top_lp, top_ids, self.bonus, self.budget, cap)[0][0, :2]  # [2, cap+1]
        tree = (build_chain(logits, self.bonus, visibility=False)[0] if mode == "chain"
                else build_ddtree(logits, self.bonus, budget, visibility=False)[0])
        return torch.stack([tree.tokens, tree.parents])  # [2, N+1]

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        self.ints_np[:] = self._host_ints([], 0, 1, 0, 0)  # base 0, p = 1: warm-up writes hit unowned rows
        self.ints.copy_(self.ints_host)
        proposals = [("tree", b) for b in reversed(self.buckets)] + [("chain", 0)]
        # per proposal two graphs: the block alone (after a long eager append) and, the usual
        # round, the ≤ B new context rows' append followed by the block (one replay)
        keys = proposals + [("append", k) for k in proposals]
        for key in keys:
            fn = (lambda key=key: self._propose_body(*key)) if key[0] != "append" \
                else (lambda key=key: (self._append_body(self.feats, self.feat_pos, self.feat_slots),
                                       self._propose_body(*key[1]))[1])
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

    def _host_ints(self, new_pos: list[int], base: int, p: int, bonus: int, budget: int) -> list[int]:
        """The int64 inputs (layout in ``__init__``) as one list: the new context rows at
        ``new_pos`` (≤ B; padded rows at position 0, slot 0 = the scratch row), meta, bonus,
        budget and the block [bonus, MASK × (B−1)] at positions p…p+B−1. One list and one numpy
        assignment: ~3× less host time per round than filling the fields one by one."""
        B, pad = self.B, [0] * (self.B - len(new_pos))
        blk = list(range(p, p + B))
        return (new_pos + pad + [base + q for q in new_pos] + pad + [base, p, B, bonus, budget]
                + [bonus] + [self.cfg.mask_token_id] * (B - 1) + blk + [base + q for q in blk] + [p + B - 1] * B)

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
        small = n <= B
        # new context rows go through the static buffers when they fit (padded rows → scratch row 0)
        self.ints_np[:] = self._host_ints(list(range(cache.length, p)) if small else [], cache.base, p, bonus,
                                          budget if mode == "tree" else B - 1)
        if small:
            self.feats_host[:n].copy_(features)
        end = 8 * len(self.ints_np) + (n * self.feats.shape[1] * self.feats.element_size() if small else 0)
        self.buf[:end].copy_(self.buf_host[:end], non_blocking=True)  # the one host → device copy
        if mode == "chain":
            key = ("chain", 0)
        else:
            key = ("tree", next(b for b in self.buckets if b >= budget))
        if n and not (small and self.graphs):  # a long context (the prompt's) or no graphs: eager append
            if small:
                feats, pos = self.feats[:n], self.feat_pos[:n]
            else:
                feats = features.to(self.device, self.embed.dtype)
                pos = torch.arange(cache.length, p, device=self.device)
            self._append_body(feats, pos, cache.base + pos)
        if self.graphs:
            g, out = self.graphs[("append", key) if n and small else key]
            g.replay()
        else:
            out = self._propose_body(*key)
        cache.length = p
        host = self.out_host[:out.numel()].view(out.shape)
        host.copy_(out, non_blocking=True)  # the one device → host copy of the round
        if out.is_cuda:
            torch.cuda.current_stream().synchronize()
        tokens, parents = host.tolist()
        keep = budget + 1 if mode == "tree" else len(tokens)
        if -1 in parents[1:keep]:  # fewer nodes than the budget (tiny vocab × depth)
            keep = parents.index(-1, 1)
        return tokens[:keep], parents[:keep]

    def release(self, request_id: str) -> bool:
        cache = self.ctx.pop(request_id, None)
        if cache is not None:
            self.pool.free(cache)
        return cache is not None
