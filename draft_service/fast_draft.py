"""DFlash drafting on the GPU from CUDA graphs: context rows in a paged KV pool, the block
forward and the DDTree build captured per tree-budget bucket (DFlash §3 / DDTree; shared DOMAIN
notes §2, §3, §6).

Context pages (issue 14 item 2, plans/0009 "Session 6"): every request's context K/V rows live in
one ``modeling.kv_cache.PagedKVPool`` (pages of ``page_rows`` rows, a free list; page 0 is the
scratch page). A request's page table is a fixed slot of ``tables`` (one int64 device tensor of
``max_requests + 1`` slots × the pages of ``max_context`` rows; slot 0, all zeros, is the padded
rows' table → the scratch page): pages are taken as its context grows (the ≤ B rows of its next
block included) and written to its slot before the replay, and all return at ``release``. The
attention reads key position s at pool row table[s // page_rows]·page_rows + s % page_rows
(``specdec_kernels.tree_attention``'s pages path); write rows are computed on the host from the table.
Only addresses change, so the drafts are bitwise those of a contiguous context (page_rows ≥ the
context: one page per request).

Draft context window (``window`` W > 0, issue 9 item 4): the block attends only to the context
from page f = ``window_start(p, W, page_rows)`` / page_rows on — the last ≥ W rows, whole
pages. No new kernel: the attention gets the request's table offset + f as its base and every
position less f·page_rows (its L and the rows' visibility limits; RoPE was applied at write
time with the absolute positions), so it walks the window's pages only. W = 0: f = 0, the
inputs as without a window. Pages wholly before the window go back to the pool after the
round's forward (``_free_before``): f never falls as a context grows, so they are never read
again, and a later forward that reuses one is ordered after this one on the stream.

Per round one graph replays: ``append`` (the ≤ block_size context rows committed last round:
fc, then per layer hidden_norm + k/v projection, k_norm and RoPE, written to the pool at their
pool rows; padded rows go to the scratch row) followed by ``propose`` (the block
[bonus, MASK × (B−1)] at positions p…p+B−1 attending to context rows < p and bidirectionally
to itself — ``specdec_kernels.tree_attention`` with every block row's visibility limit at p+B−1 — then
the target LM head at slots 1…B−1 and the DDTree build at the bucket's budget: the top-K
log-probs per depth (``specdec_kernels.topk_logprobs``, two launches, for K ≤ 64; log_softmax +
``torch.topk`` above), then the one-launch best-first kernel ``specdec_kernels.ddtree_build``). Both use the target
fast path's kernels (row RMSNorm, fixed-tile matmuls, q/k-norm + RoPE + KV write, SwiGLU).
Inputs (the new rows' positions, slots and features, the block's tokens, positions, slots and
visibility, meta, bonus, budget) reach the device in one copy from a pinned buffer; the tree
comes back in one copy. A tree built at bucket budget b' ≥ b truncated to its first b nodes is
the budget-b tree: nodes come in best-first order and the top-b prefixes are prefix-closed. A
longer context (the prompt's) is appended eagerly by the same code, then the block alone
replays. The drafter need not be row-invariant: it only steers what is proposed, never what is
emitted.

Batches (``draft_batch``, issue 14 / plans/0009 §6): the blocks of nb requests run as one
forward of nb·B rows — one append of every request's ≤ B new context rows (packed), the blocks
with per-row (base, p) through ``tree_attention(row_meta=…)``, the LM head, the top-K and the
tree build batched over requests at the batch's largest budget bucket (each request's tree is
that tree truncated to its own budget; a chain is the top-1 id per depth) — and come back in
one copy. Graphs per (batch bucket ≥ 2, budget bucket or chain), padded requests and rows
writing and reading only the scratch row; without graphs the same body runs unpadded. A batch
of one stays on the single-request graphs above. Every kernel is row-invariant, so on the GPU
a request's tree in a batch is its solo tree (except when the batch's bucket crosses ``MAX_K``
and the request's own does not: log_softmax + topk then replace the fused top-K, whose
log-probs differ by ulps; a different tree there changes speed, never output).
"""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

import numpy as np
import torch

from draft_service.ddtree import _log_probs, build_chain, build_ddtree
from specdec_kernels.ddtree_build import build_ddtree_topk
from specdec_kernels.matmul import linear
from specdec_kernels.rmsnorm_rows import rmsnorm
from specdec_kernels.rope import inv_freq, rope_qkv
from specdec_kernels.swiglu import swiglu
from specdec_kernels.topk_logprobs import MAX_K, topk_log_probs
from specdec_kernels.tree_attention import tree_attention
from modeling.dflash import DFlashDrafter, window_start
from modeling.kv_cache import PAGE_ROWS, PagedCache, PagedKVPool

BUDGET_BUCKETS = (4, 16, 64, 128, 256, 512)
BATCH_BUCKETS = (2, 4, 8, 16, 32, 64)  # requests per batched forward (1 = the single-request graphs)


# SPECDEC_FUSED_TOPK=0: log_softmax + torch.topk on CUDA too (the session-4 first cut; to
# compare, or to fall back should the fused top-K misbehave on a GPU)
FUSED_TOPK = os.environ.get("SPECDEC_FUSED_TOPK", "1") != "0"


def ranked_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., V] float → (top-k log-probs [..., k] float32 descending, ids [..., k] int64):
    on CUDA the fused kernel for k ≤ ``specdec_kernels.topk_logprobs.MAX_K``, else (and on the CPU,
    where Triton's interpreter sorts slowly) log_softmax + torch.topk."""
    if FUSED_TOPK and logits.is_cuda and k <= MAX_K:
        return topk_log_probs(logits, k)
    return _log_probs(logits).topk(k, dim=-1)


class GraphedDrafter:
    """Args: drafter (on a CUDA device), embed / lm_head [V, H] (the target's, same device and
    dtype), pool_rows (context rows of all live requests together, rounded up to whole pages),
    max_tree_budget, graphs (False:
    the same code eagerly, for tests and ``--no-graphs``), fused_tree (build the tree with the
    one-launch kernel ``specdec_kernels.ddtree_build`` after ``ranked_log_probs``; default on CUDA; False: the
    batched torch builder of ``draft_service.ddtree``, ~60 small launches), max_batch (requests per
    batched forward: batch buckets ``BATCH_BUCKETS`` below it, then max_batch itself; 1 = no
    batched graphs, ``draft_batch`` loops), page_rows (rows per context page), max_requests (live
    contexts: page-table slots), max_context (rows per context: a table slot's pages), window
    (the draft context window in rows, 0 = the full context; see the module docstring)."""

    def __init__(self, drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor,
                 pool_rows: int, max_tree_budget: int = 512, graphs: bool = True,
                 fused_tree: bool | None = None, max_batch: int = 64, page_rows: int = PAGE_ROWS,
                 max_requests: int = 256, max_context: int = 8192, window: int = 0):
        c = self.cfg = drafter.config
        self.window = window
        self.drafter, self.embed, self.lm_head = drafter, embed, lm_head
        dev, dt, B = embed.device, embed.dtype, c.block_size
        self.device, self.B = dev, B
        self.pool = PagedKVPool(c.num_hidden_layers, pool_rows, c.num_key_value_heads, c.head_dim, dev, dt, page_rows)
        self.ctx: dict[str, PagedCache] = {}
        # page tables: slot t (1…max_requests) at tables[t·table_pages …], slot 0 the scratch's
        self.table_pages = min(self.pool.pages, self.pool.pages_for(max_context))
        self.tables = torch.zeros((max_requests + 1) * self.table_pages, dtype=torch.int64, device=dev)
        self.table: dict[str, int] = {}  # request → its table's offset in ``tables``
        self._free_tables = list(range(max_requests, 0, -1))
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
        self.meta = self.ints[2 * B:2 * B + 3]  # (table offset, p, B): tree_attention's meta
        self.bonus = self.ints[2 * B + 3:2 * B + 4]
        self.budget = self.ints[2 * B + 4:2 * B + 5]  # nodes to build (≤ the bucket's capacity)
        # the block [bonus, MASK × (B−1)] at p…p+B−1, each row seeing all B block rows
        self.blk_tok, self.blk_pos, self.blk_slots, self.blk_vis = self.ints[2 * B + 5:].view(4, B)
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
        # batched inputs (``_batch_views``): one byte buffer for the largest batch bucket, read by
        # every bucket's graphs at offset 0 with that bucket's layout, and its pinned host mirror
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + ([max_batch] if max_batch > 1 else [])
        nb_max = max(self.batch_buckets, default=0)
        size = 8 * (8 * nb_max * B + 4 + nb_max) + nb_max * B * width * embed.element_size()
        self.bbuf = torch.zeros(size, dtype=torch.uint8, device=dev)
        self.bbuf_host = torch.zeros(size, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        self.bviews = {nb: self._batch_views(nb) for nb in self.batch_buckets}
        self.block_anc = torch.arange(B, dtype=torch.int32, device=dev).repeat(max(B, nb_max * B))  # row stride B
        # the trees of a batch [nb, 2·(capacity+1) + B−1] (tokens, parents, chain ids) come back here
        self.bout_host = torch.zeros(nb_max * (2 * (self.buckets[-1] + 1) + B - 1), dtype=torch.int64,
                                     pin_memory=dev.type == "cuda")
        self.graphs: dict[object, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.capture_seconds = self.batch_capture_seconds = 0.0  # all graphs; the batch graphs' share
        if graphs:
            self.capture()

    # -- the captured bodies ---------------------------------------------------------------
    def _append_body(self, feats, positions, slots) -> None:
        """Context rows feats [n, width] at positions [n] int64: fc and hidden_norm once, then
        per layer the k/v projection, k_norm + RoPE, written to pool rows ``slots`` [n] int64."""
        c, eps = self.cfg, self.cfg.rms_norm_eps
        ctx = rmsnorm(linear(feats, self.drafter.fc.weight), self.drafter.hidden_norm.weight, eps)  # [n, H]
        for i, w in enumerate(self.layers):
            kv = linear(ctx, w["wkv"])
            rope_qkv(kv, positions, self.freqs, slots, self.pool.k[i], self.pool.v[i], 0, c.num_key_value_heads,
                     w["q_norm"], w["k_norm"], eps)

    def _block_logits(self, tokens, positions, slots, vis, meta, row_meta=None) -> torch.Tensor:
        """The blocks [bonus, MASK × (B−1)] of nb requests, rows [nb·B] int64 each (tokens,
        positions p…p+B−1, pool rows, visibility limit p+B−1), through the drafter's layers
        (``tree_attention`` over the page tables with ``meta``'s (table offset, p, B), or per
        row ``row_meta`` [nb·B, 2] (table offset, p)) and the target LM head: logits
        [nb, B−1, V] float32, the same-position predictions at depths 1…B−1."""
        c, B, eps = self.cfg, self.B, self.cfg.rms_norm_eps
        h, g = c.num_attention_heads, c.num_key_value_heads
        x = self.embed[tokens]
        for i, w in enumerate(self.layers):
            kp, vp = self.pool.k[i], self.pool.v[i]
            qkv = linear(rmsnorm(x, w["ln1"], eps), w["wqkv"])
            q = rope_qkv(qkv, positions, self.freqs, slots, kp, vp, h, g, w["q_norm"], w["k_norm"], eps)
            attn = tree_attention(q, kp, vp, vis, self.block_anc, meta, row_meta, self.tables, self.pool.page_rows)
            x = linear(attn, w["wo"], residual=x)
            x = linear(swiglu(linear(rmsnorm(x, w["ln2"], eps), w["wgu"])), w["wdown"], residual=x)
        nb = x.shape[0] // B
        x = x.view(nb, B, -1)[:, 1:].reshape(nb * (B - 1), -1)  # slot 0's output is unused
        return linear(rmsnorm(x, self.drafter.norm.weight, eps), self.lm_head, out_dtype=torch.float32).view(nb, B - 1, -1)

    def _propose_body(self, mode: str, budget: int):
        c, B = self.cfg, self.B
        logits = self._block_logits(self.blk_tok, self.blk_pos, self.blk_slots, self.blk_vis, self.meta)  # [1, B-1, V]
        if self.fused_tree:  # top-K, then one launch; a chain is the tree with K = 1, budget B−1
            cap = B - 1 if mode == "chain" else budget
            top_lp, top_ids = ranked_log_probs(logits, 1 if mode == "chain" else min(budget, c.vocab_size))
            return build_ddtree_topk(top_lp, top_ids, self.bonus, self.budget, cap)[0][0, :2]  # [2, cap+1]
        tree = (build_chain(logits, self.bonus, visibility=False)[0] if mode == "chain"
                else build_ddtree(logits, self.bonus, budget, visibility=False)[0])
        return torch.stack([tree.tokens, tree.parents])  # [2, N+1]

    def _batch_views(self, nb: int) -> SimpleNamespace:
        """Batch bucket nb's inputs, views of ``bbuf`` from offset 0 (device) and of its host
        mirror (numpy, same names with ``_h``), R = nb·B rows: int64 [new context rows'
        positions (R) | their pool rows (R) | row_meta (R × 2: table offset, p; both shifted by a
        window) | block tokens (R) | block
        positions (R) | block slots (R) | block visibility limits (R) | meta (3: 0, 0, B) |
        budget | bonus (nb)], then the new rows' features [R, width] in the model dtype."""
        B, R = self.B, nb * self.B
        n_ints = 8 * R + 4 + nb
        ints, ints_h = self.bbuf[:8 * n_ints].view(torch.int64), self.bbuf_host[:8 * n_ints].view(torch.int64).numpy()
        width = len(self.cfg.target_layer_ids) * self.cfg.hidden_size
        feats = [b[8 * n_ints:].view(self.embed.dtype)[:R * width].view(R, width) for b in (self.bbuf, self.bbuf_host)]
        v = SimpleNamespace(nb=nb, n_ints=n_ints, feats=feats[0], feats_h=feats[1], ints_h=ints_h)
        for name, t in (("", ints), ("_h", ints_h)):
            for k, part in (("feat_pos", t[:R]), ("feat_slots", t[R:2 * R]), ("row_meta", t[2 * R:4 * R].reshape(R, 2)),
                            ("blk", t[4 * R:8 * R].reshape(4, R)), ("meta", t[8 * R:8 * R + 3]),
                            ("budget", t[8 * R + 3:8 * R + 4]), ("bonus", t[8 * R + 4:n_ints])):
                setattr(v, k + name, part)
        return v

    def _batch_body(self, nb: int, cap: int, rows: int | None = None) -> torch.Tensor:
        """Append (the first ``rows`` packed context rows; None: all nb·B, as captured) + the
        blocks of nb requests, then per request the chain ids (top-1 per depth) and, cap > 0,
        the best-first tree at capacity cap built to ``budget`` nodes (fused: top-K + one launch
        over the nb requests; else the batched torch builder). Returns int64 [nb, B−1] (cap 0)
        or [nb, 2·(N+1) + B−1] (tree tokens | tree parents | chain ids)."""
        v = self.bviews[nb]
        if rows != 0:
            self._append_body(v.feats[:rows], v.feat_pos[:rows], v.feat_slots[:rows])
        logits = self._block_logits(*v.blk, v.meta, v.row_meta)  # [nb, B-1, V]
        chain = ranked_log_probs(logits, 1)[1][..., 0]  # the chain: what the K = 1 build takes
        if not cap:
            return chain
        if self.fused_tree:
            top_lp, top_ids = ranked_log_probs(logits, min(cap, self.cfg.vocab_size))
            tree = build_ddtree_topk(top_lp, top_ids, v.bonus, v.budget, cap)[0][:, :2]  # [nb, 2, cap+1]
        else:
            tree = torch.stack([torch.stack([t.tokens, t.parents])
                                for t in build_ddtree(logits, v.bonus, cap, visibility=False)])  # [nb, 2, N+1]
        return torch.cat([tree.reshape(nb, -1), chain], 1)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle()
        self.ints_np[:] = self._host_ints([], [], 0, 0, [0] * self.B, 0, 0)  # warm-up: scratch table and row
        self.ints.copy_(self.ints_host)
        proposals = [("tree", b) for b in reversed(self.buckets)] + [("chain", 0)]
        # per proposal two graphs: the block alone (after a long eager append) and, the usual
        # round, the ≤ B new context rows' append followed by the block (one replay)
        keys = proposals + [("append", k) for k in proposals]
        # batched: per (batch bucket, budget bucket or 0 = chains only) one graph, append + blocks
        # (all-zero inputs: every row at position 0 writes and reads the scratch row only)
        batched = [("batch", nb, cap) for nb in reversed(self.batch_buckets) for cap in [*reversed(self.buckets), 0]]
        for key in batched + keys:
            if key == keys[0]:
                self.batch_capture_seconds = time.perf_counter() - t0
            if key[0] == "batch":
                v = self.bviews[key[1]]
                v.ints_h[:] = 0
                v.meta_h[2] = self.B
                self.bbuf.copy_(self.bbuf_host)
                fn = lambda key=key: self._batch_body(*key[1:])
            else:
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
    def context(self, request_id: str) -> PagedCache | None:
        return self.ctx.get(request_id)

    def new_context(self, request_id: str, rows: int) -> PagedCache:
        """A context for a new request id with pages for ``rows`` rows (0: none yet). Raises
        MemoryError (nothing kept) when no page-table slot (max_requests) or too few pages are
        free."""
        if not self._free_tables:
            raise MemoryError(f"all {len(self.tables) // self.table_pages - 1} page tables (max_requests) in use")
        self.ctx[request_id] = cache = self.pool.allocate(0)
        self.table[request_id] = self._free_tables.pop() * self.table_pages
        try:
            self._ensure(request_id, rows)
        except MemoryError:
            self.release(request_id)
            raise
        return cache

    def _ensure(self, request_id: str, rows: int) -> PagedCache:
        """Take pages until the request's context holds ``rows`` rows and write them to its page
        table (a small host → device copy, ordered before the next replay). Raises MemoryError
        (context unchanged) when too few pages are free or the table would overflow
        (max_context)."""
        cache = self.ctx[request_id]
        have = len(cache.pages)
        if self.pool.pages_for(rows) <= have:
            return cache
        if self.pool.pages_for(rows) > self.table_pages:
            raise MemoryError(f"{rows} context rows exceed a page table's {self.table_pages} pages "
                              f"of {self.pool.page_rows} rows (max_context)")
        new = self.pool.grow(cache, rows)
        at = self.table[request_id] + have
        self.tables[at:at + len(new)].copy_(torch.tensor(new, dtype=torch.int64), non_blocking=True)
        return cache

    def _rows(self, cache: PagedCache, lo: int, hi: int) -> list[int]:
        """Pool rows of the request's positions lo…hi−1 (inside its pages)."""
        P = self.pool.page_rows
        if hi > lo and lo // P == (hi - 1) // P:  # one page: the usual round
            r = cache.pages[lo // P] * P + lo % P
            return list(range(r, r + hi - lo))
        return cache.rows(range(lo, hi)).tolist()

    def _first_page(self, p: int) -> int:
        """The window's first page (an index into the request's table) for a block at p."""
        return window_start(p, self.window, self.pool.page_rows) // self.pool.page_rows

    def _host_ints(self, new_pos: list[int], new_rows: list[int], table: int, p: int, blk_rows: list[int],
                   bonus: int, budget: int) -> list[int]:
        """The int64 inputs (layout in ``__init__``) as one list: the new context rows at
        positions ``new_pos`` and pool rows ``new_rows`` (≤ B; padded rows at position 0, pool
        row 0 = the scratch row), meta (the request's table offset, p, B — both shifted by the
        window's first page f: offset + f, p − f·page_rows), bonus, budget and the block
        [bonus, MASK × (B−1)] at positions p…p+B−1, pool rows ``blk_rows`` [B], visibility
        limit p+B−1 (− f·page_rows). One list and one numpy assignment: ~3× less host time
        per round than filling the fields one by one."""
        B, pad = self.B, [0] * (self.B - len(new_pos))
        f = self._first_page(p)
        L = p - f * self.pool.page_rows
        return (new_pos + pad + new_rows + pad + [table + f, L, B, bonus, budget]
                + [bonus] + [self.cfg.mask_token_id] * (B - 1) + list(range(p, p + B)) + blk_rows + [L + B - 1] * B)

    @torch.inference_mode()
    def draft(self, request_id: str, features: torch.Tensor, bonus: int, mode: str, budget: int
              ) -> tuple[list[int], list[int]]:
        """Append features [n, taps·H] at positions length…length+n−1 of the request's context
        (created by ``new_context``) and propose a tree rooted at ``bonus``. Returns (tokens,
        parents) flat, index 0 = root. Raises MemoryError when the pool has no room."""
        n, B = features.shape[0], self.B
        cache = self.ctx[request_id]
        p = cache.length + n
        self._ensure(request_id, p + B)
        small = n <= B
        # new context rows go through the static buffers when they fit (padded rows → scratch row 0)
        rows = self._rows(cache, cache.length if small else p, p + B)
        self.ints_np[:] = self._host_ints(list(range(cache.length, p)) if small else [], rows[:-B],
                                          self.table[request_id], p, rows[-B:], bonus,
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
                slots = self.feat_slots[:n]
            else:
                feats = features.to(self.device, self.embed.dtype)
                pos = torch.arange(cache.length, p, device=self.device)
                slots = torch.as_tensor(cache.rows(range(cache.length, p)), device=self.device)
            self._append_body(feats, pos, slots)
        if self.graphs:
            g, out = self.graphs[("append", key) if n and small else key]
            g.replay()
        else:
            out = self._propose_body(*key)
        cache.length = p
        self._free_before(cache, self._first_page(p))
        host = self.out_host[:out.numel()].view(out.shape)
        host.copy_(out, non_blocking=True)  # the one device → host copy of the round
        if out.is_cuda:
            torch.cuda.current_stream().synchronize()
        tokens, parents = host.tolist()
        keep = budget + 1 if mode == "tree" else len(tokens)
        if -1 in parents[1:keep]:  # fewer nodes than the budget (tiny vocab × depth)
            keep = parents.index(-1, 1)
        return tokens[:keep], parents[:keep]

    @torch.inference_mode()
    def draft_batch(self, items: list[tuple[str, torch.Tensor, int, str, int]]
                    ) -> list[tuple[list[int], list[int]] | MemoryError]:
        """Draft several requests in one forward. items: (request_id, features [n, taps·H],
        bonus, mode, nodes) per request — distinct ids with contexts from ``new_context``;
        nodes = the tree's nodes (tree mode, 1…max_tree_budget; ignored for a chain). Returns
        per item what ``draft`` returns for it alone, or the MemoryError it raised (no room in
        the pool to grow its context; its context is unchanged) or the exception its chunk's
        forward raised (unexpected; context lengths unchanged). More items than the largest
        batch bucket run in chunks of it; a batch (or last chunk) of one runs ``draft``."""
        out: list = [None] * len(items)
        ready = []
        for i, (rid, feats, *_) in enumerate(items):
            try:
                self._ensure(rid, self.ctx[rid].length + feats.shape[0] + self.B)
                ready.append(i)
            except MemoryError as e:
                out[i] = e
        step = max(self.batch_buckets, default=1)
        for k in range(0, len(ready), step):
            chunk = ready[k:k + step]
            try:
                trees = [self.draft(*items[chunk[0]])] if len(chunk) == 1 else self._draft_chunk([items[i] for i in chunk])
            except Exception as e:  # noqa: BLE001 — the chunk's forward failed: its items get the error, lengths kept
                trees = [e] * len(chunk)
            for i, tree in zip(chunk, trees):
                out[i] = tree
        return out

    def _draft_chunk(self, items) -> list[tuple[list[int], list[int]]]:
        """2 ≤ len(items) ≤ the largest batch bucket, capacities ensured: one replay of the
        (batch bucket, budget bucket) graph (contexts longer than B rows appended eagerly
        first), one copy back, trees cut to each request's nodes."""
        B, m = self.B, len(items)
        if self.graphs:  # padded to the batch bucket
            v = self.bviews[next(b for b in self.batch_buckets if b >= m)]
        else:  # eager: no padded requests or rows
            v = self.bviews[m] if m in self.bviews else self.bviews.setdefault(m, self._batch_views(m))
        caches = [self.ctx[it[0]] for it in items]
        ns = [it[1].shape[0] for it in items]
        bonuses = [it[2] for it in items]
        nodes = [it[4] for it in items if it[3] == "tree"]
        cap = next(b for b in self.buckets if b >= max(nodes)) if nodes else 0
        tables = [self.table[it[0]] for it in items]
        ps = np.array([c.length + n for c, n in zip(caches, ns)])
        first = np.array([self._first_page(int(q)) for q in ps])  # the windows' first pages (0: none)
        Ls = ps - first * self.pool.page_rows  # positions as the attention sees them (window-relative)
        R = m * B
        v.ints_h[:] = 0  # padded requests: every row at position 0 of table 0, pool row 0 (the scratch row)
        tok, pos, slots, vis = v.blk_h
        tok[:R] = self.cfg.mask_token_id
        tok[:R:B] = bonuses
        pos[:R] = (ps[:, None] + np.arange(B)).ravel()
        vis[:R] = np.repeat(Ls + B - 1, B)
        v.row_meta_h[:R, 0], v.row_meta_h[:R, 1] = np.repeat(np.array(tables) + first, B), np.repeat(Ls, B)
        v.meta_h[2], v.budget_h[0], v.bonus_h[:m] = B, max(nodes, default=0), bonuses
        r, long = 0, []
        for j, (c, (_, f, *_), n) in enumerate(zip(caches, items, ns)):  # ≤ B new rows each: packed
            rows = self._rows(c, c.length if n <= B else c.length + n, c.length + n + B)
            slots[j * B:(j + 1) * B] = rows[-B:]
            if n > B:
                long.append((c, f))
            elif n:
                v.feat_pos_h[r:r + n] = np.arange(c.length, c.length + n)
                v.feat_slots_h[r:r + n] = rows[:n]
                v.feats_h[r:r + n].copy_(f)
                r += n
        end = 8 * v.n_ints + r * v.feats.shape[1] * v.feats.element_size()
        self.bbuf[:end].copy_(self.bbuf_host[:end], non_blocking=True)  # the one host → device copy
        for c, f in long:  # a prompt's context: eager append, then the block in the batch
            p = torch.arange(c.length, c.length + f.shape[0], device=self.device)
            rows = torch.as_tensor(c.rows(range(c.length, c.length + f.shape[0])), device=self.device)
            self._append_body(f.to(self.device, self.embed.dtype), p, rows)
        if self.graphs:
            g, out = self.graphs[("batch", v.nb, cap)]
            g.replay()
        else:
            out = self._batch_body(v.nb, cap, r)
        for c, n, f in zip(caches, ns, first):
            c.length += n
            self._free_before(c, int(f))
        host = self.bout_host[:m * out.shape[1]].view(m, out.shape[1])
        host.copy_(out[:m], non_blocking=True)  # the one device → host copy
        if out.is_cuda:
            torch.cuda.current_stream().synchronize()
        h, W = host.numpy(), (out.shape[1] - (B - 1)) // 2  # W: tree width (capacity + 1), 0 for chains only
        trees = []
        for i, (_, _, bonus, mode, k) in enumerate(items):
            if mode == "chain":
                trees.append(([bonus] + h[i, 2 * W:].tolist(), list(range(-1, B - 1))))
                continue
            keep = min(k + 1, W)
            parents = h[i, W:W + keep].tolist()
            if -1 in parents[1:]:  # fewer nodes than the budget (tiny vocab × depth)
                keep = parents.index(-1, 1)
            trees.append((h[i, :keep].tolist(), parents[:keep]))
        return trees

    def _free_before(self, cache: PagedCache, first: int) -> None:
        """Return the cache's pages before its window's first page ``first`` to the pool; 0 (the
        scratch page, never handed out) takes their place in ``cache.pages``, so positions keep
        their pages; the table's entries stay (never read again)."""
        i, gone = first - 1, []
        while i >= 0 and cache.pages[i]:  # the pages freed earlier are a prefix
            gone.append(cache.pages[i])
            cache.pages[i] = 0
            i -= 1
        if gone:
            self.pool.free(PagedCache(self.pool, gone, 0))

    def release(self, request_id: str) -> bool:
        """Return the request's pages (those a window left) and page-table slot; False for an
        unknown id."""
        cache = self.ctx.pop(request_id, None)
        if cache is not None:
            cache.pages = [q for q in cache.pages if q]
            self.pool.free(cache)
            self._free_tables.append(self.table.pop(request_id) // self.table_pages)
        return cache is not None
