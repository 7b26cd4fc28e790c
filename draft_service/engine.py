"""Draft engine: per-request drafter context (KV injection) and tree building. Free of gRPC.

A request's first call binds its mode (chain | tree) and tree budget (plans/0004); later
calls carry only the new context features and the bonus token.
A draft context window (``window`` W > 0, issue 9 item 4): the block attends only to the last
≥ W context rows — whole pages of ``context_page_rows`` from ``modeling.dflash.window_start``,
the same on both paths — at their absolute positions; W = 0 is the full context.
Per call: append the context K/V rows of tokens committed since the last call, run the block
[bonus, MASK×(B−1)] at positions p…p+B−1 (p = committed length), take the target LM head's
logits at slots 1…B−1 as the drafter's distributions at depths 1…B−1, and build a chain
(top-1 path) or a DDTree under the budget — or this round's ``round_budget`` (≤ the bound
budget; the orchestrator's adaptive budget, issue 14).
``draft_batch`` serves several requests' calls at once (the worker's step batcher, issue 14):
each item is checked on its own, the valid ones run as one forward on the fast path.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from draft_service.ddtree import build_chain, build_ddtree
from modeling.dflash import DFlashDrafter, window_start
from protocol.types import FailedPrecondition, InvalidRequest, ResourceExhausted

MODES = ("chain", "tree")


@dataclass
class DraftItem:
    """One request's draft call: context features [n, taps·H] at positions context_start…,
    the bonus token; mode / budget (tree nodes) bind at the request's first call;
    round_budget (tree mode; None or 0 = the bound budget): this round's nodes, 1…budget."""
    request_id: str
    features: torch.Tensor
    context_start: int
    bonus: int
    mode: str | None = None
    budget: int | None = None
    round_budget: int | None = None


@dataclass
class _Context:
    k: torch.Tensor  # [layers, capacity, g, d]
    v: torch.Tensor
    mode: str        # bound by the request's first call
    tree_budget: int
    length: int = 0


class DraftEngine:
    """Serves one drafter. Args: drafter, the target's embedding and LM-head weights
    (both [V, H]), max_tree_budget (tree nodes), max_context (positions per request), max_requests
    (live request contexts), name (for GetInfo), fast, context_pool_tokens (the fast path's context
    pool, in pages of context_page_rows rows taken as a context grows), max_batch (requests per
    batched forward on the fast path; batch graphs per bucket up to it), window (the draft
    context window in rows, 0 = the full context; rounded up to whole pages of
    context_page_rows, on the CPU path too). Thread-safe (one forward at a time). Raises
    ValueError for a negative window."""

    def __init__(self, drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor,
                 max_tree_budget: int = 512, max_context: int = 8192, max_requests: int = 256,
                 name: str = "dflash", fast: str = "off", context_pool_tokens: int = 1 << 16,
                 max_batch: int = 64, context_page_rows: int = 128, window: int = 0):
        if window < 0:
            raise ValueError(f"window must be >= 0 (0 = the full context), got {window}")
        self.drafter, self.name = drafter, name
        self.window, self.page_rows = window, context_page_rows
        self.cfg = drafter.config
        self.embed, self.lm_head = embed, lm_head
        self.device, self.dtype = embed.device, embed.dtype
        self.max_tree_budget, self.max_context, self.max_requests = max_tree_budget, max_context, max_requests
        self.context_pool_tokens = context_pool_tokens
        self.feature_width = len(self.cfg.target_layer_ids) * self.cfg.hidden_size
        self._ctx: dict[str, _Context] = {}
        self._lock = threading.Lock()
        # fast: "off" (eager torch, per-request tensors; CPU) | "eager" | "graphs" (GPU: context
        # rows in one paged pool of context_pool_tokens rows, block + tree build from CUDA graphs)
        self.fast = None
        if fast != "off":
            from draft_service.fast_draft import GraphedDrafter

            self.fast = GraphedDrafter(drafter, embed, lm_head, context_pool_tokens, max_tree_budget, fast == "graphs",
                                       max_batch=max_batch, page_rows=context_page_rows, max_requests=max_requests,
                                       max_context=max_context, window=window)

    @property
    def _pool_limit(self) -> str:
        pool = self.fast.pool
        return f"context_pool_tokens {self.context_pool_tokens}: {pool.pages} pages of {pool.page_rows} rows"

    @property
    def live_requests(self) -> int:
        return len(self._ctx)

    def holds(self, request_id: str) -> bool:
        """True when ``request_id`` has a drafter context (its first draft call bound mode and budget)."""
        return request_id in self._ctx

    def _check_mode(self, mode, budget) -> None:
        if mode not in MODES:
            raise InvalidRequest(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "tree" and not (isinstance(budget, int) and 1 <= budget <= self.max_tree_budget):
            raise InvalidRequest(f"tree_budget must be in [1, {self.max_tree_budget}], got {budget}")

    def _context(self, request_id: str, start: int, n: int, mode, budget) -> _Context:
        ctx = self._ctx.get(request_id)
        if ctx is None:
            self._check_mode(mode, budget)
            if start != 0:
                raise FailedPrecondition(f"request_id {request_id!r} has no drafter context; "
                                         f"context_start must be 0, got {start}")
            if len(self._ctx) >= self.max_requests:
                raise ResourceExhausted(f"drafter holds max_requests {self.max_requests} contexts")
            c = self.cfg
            if self.fast is not None:  # rows live in the fast drafter's pool
                try:
                    self.fast.new_context(request_id, n + c.block_size)
                except MemoryError as e:
                    raise ResourceExhausted(f"drafter context pool full: {e} ({self._pool_limit})") from None
                ctx = self._ctx[request_id] = _Context(None, None, mode, budget or 0)
                return ctx
            shape = (c.num_hidden_layers, max(64, n), c.num_key_value_heads, c.head_dim)
            ctx = _Context(torch.zeros(shape, device=self.device, dtype=self.dtype),
                           torch.zeros(shape, device=self.device, dtype=self.dtype), mode, budget or 0)
            self._ctx[request_id] = ctx
        elif start != ctx.length:
            raise FailedPrecondition(f"context_start must be {ctx.length} (the drafter's context "
                                     f"length for {request_id!r}), got {start}")
        need = ctx.length + n
        if self.fast is None and need > ctx.k.shape[1]:  # grow by doubling
            cap = max(need, 2 * ctx.k.shape[1])
            pad = (0, 0, 0, 0, 0, cap - ctx.k.shape[1])
            ctx.k = torch.nn.functional.pad(ctx.k, pad)
            ctx.v = torch.nn.functional.pad(ctx.v, pad)
        return ctx

    def draft(self, request_id: str, features: torch.Tensor, context_start: int, bonus: int,
              mode: str | None = None, budget: int | None = None, round_budget: int | None = None
              ) -> tuple[list[int], list[int]]:
        """Append context features [n, taps·H] (positions context_start…) and draft a tree
        rooted at ``bonus``. Returns (tokens, parents) flat, index 0 = root. ``mode`` and
        ``budget`` (the tree budget) are bound by the request's first call (context_start 0)
        and may be left out later; ``round_budget`` (tree mode; None or 0 = the bound budget)
        is this round's node count, 1…the bound budget. ``draft_batch`` of one item.

        Raises InvalidRequest (field + limit), FailedPrecondition (context out of sync),
        ResourceExhausted (too many live contexts, or the context pool full)."""
        out = self.draft_batch([DraftItem(request_id, features, context_start, bonus, mode, budget, round_budget)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    @torch.inference_mode()
    def draft_batch(self, items: list[DraftItem]) -> list[tuple[list[int], list[int]] | Exception]:
        """Draft every item (see ``draft``), each on its own: an invalid item gets its exception
        (InvalidRequest, FailedPrecondition — also for a request id already in this batch —,
        ResourceExhausted) and changes nothing; the others draft as if alone. On the fast path
        the valid items run in one forward (``GraphedDrafter.draft_batch``); off it, one after
        the other. Returns per item (tokens, parents) or the exception."""
        out: list = [None] * len(items)
        with self._lock:
            run, created, seen = [], [], set()  # run: (index, context, tree nodes or 0 for a chain)
            for i, it in enumerate(items):
                try:
                    if it.request_id in seen:
                        raise FailedPrecondition(f"request_id {it.request_id!r} appears twice in one draft batch")
                    seen.add(it.request_id)
                    nodes = self._check(it)
                    known = it.request_id in self._ctx
                    ctx = self._context(it.request_id, it.context_start, it.features.shape[0], it.mode, it.budget)
                except (InvalidRequest, FailedPrecondition, ResourceExhausted) as e:
                    out[i] = e
                    continue
                if not known:
                    created.append(it.request_id)
                run.append((i, ctx, nodes or ctx.tree_budget))
            if self.fast is None:  # one item after the other
                trees = []
                for i, ctx, nodes in run:
                    try:
                        trees.append(self._draft_eager(ctx, items[i], nodes))
                    except Exception as e:  # noqa: BLE001 — unexpected: that item's error (its length unchanged)
                        trees.append(e)
            else:
                trees = self.fast.draft_batch([(items[i].request_id, items[i].features, items[i].bonus, ctx.mode, nodes)
                                               for i, ctx, nodes in run])
            for (i, ctx, _), tree in zip(run, trees):
                it = items[i]
                if isinstance(tree, MemoryError):
                    tree = ResourceExhausted(f"drafter context pool full: {tree} ({self._pool_limit})")
                if isinstance(tree, Exception):
                    if it.request_id in created:  # nothing stays of a failed item
                        self._drop(it.request_id)
                else:
                    ctx.length = it.context_start + it.features.shape[0]
                out[i] = tree
        return out

    def _check(self, it: DraftItem) -> int:
        """Checks that need no state change; returns the round's tree nodes (0: the bound budget)."""
        c, ctx = self.cfg, self._ctx.get(it.request_id)
        if ctx is None:
            self._check_mode(it.mode, it.budget)
        f = it.features
        if not isinstance(f, torch.Tensor) or f.dim() != 2 or f.shape[1] != self.feature_width:
            raise InvalidRequest(f"context_features must be [n, {self.feature_width}], got "
                                 f"{list(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__}")
        if not 0 <= it.bonus < c.vocab_size:
            raise InvalidRequest(f"bonus_token must be in [0, {c.vocab_size}), got {it.bonus}")
        mode, bound = (it.mode, it.budget) if ctx is None else (ctx.mode, ctx.tree_budget)
        if it.round_budget:
            if mode != "tree":
                raise InvalidRequest(f"round_budget is for tree mode only (request {it.request_id!r} "
                                     f"drafts a {mode}), got {it.round_budget}")
            if not 1 <= it.round_budget <= bound:
                raise InvalidRequest(f"round_budget must be in [1, {bound}] (the bound tree_budget), "
                                     f"got {it.round_budget}")
        p = it.context_start + f.shape[0]
        if p + c.block_size > self.max_context:
            raise InvalidRequest(f"position {p} + block_size {c.block_size} exceeds max_context {self.max_context}")
        pool = self.fast.pool if self.fast is not None else None
        if pool is not None and pool.pages_for(p + c.block_size) > pool.pages:
            raise ResourceExhausted(f"position {p} + block_size {c.block_size} context rows can never fit "
                                    f"the drafter's pool ({self._pool_limit})")
        return it.round_budget or 0

    def _drop(self, request_id: str) -> None:
        self._ctx.pop(request_id, None)
        if self.fast is not None:
            self.fast.release(request_id)

    def _draft_eager(self, ctx: _Context, it: DraftItem, nodes: int) -> tuple[list[int], list[int]]:
        """The CPU path for one item: append its context rows, run its block, build its tree."""
        c = self.cfg
        p = it.context_start + it.features.shape[0]
        if p > ctx.length:
            pos = torch.arange(ctx.length, p, device=self.device)
            for i, (k, v) in enumerate(self.drafter.context_kv(it.features.to(self.device, self.dtype), pos)):
                ctx.k[i, ctx.length:p] = k
                ctx.v[i, ctx.length:p] = v
            ctx.length = p
        block = torch.full((c.block_size,), c.mask_token_id, dtype=torch.int64, device=self.device)
        block[0] = it.bonus
        s = window_start(p, self.window, self.page_rows)
        kv = [(ctx.k[i, s:p], ctx.v[i, s:p]) for i in range(c.num_hidden_layers)]
        hidden = self.drafter(self.embed[block], torch.arange(p, p + c.block_size, device=self.device), kv)
        logits = (hidden[1:] @ self.lm_head.T).float()[None]  # [1, B-1, V]
        root = torch.tensor([it.bonus], device=self.device)
        tree = build_chain(logits, root)[0] if ctx.mode == "chain" else build_ddtree(logits, root, nodes)[0]
        return tree.tokens.tolist(), tree.parents.tolist()

    def release(self, request_ids: list[str]) -> int:
        """Drop the requests' drafter contexts; unknown ids are ignored."""
        with self._lock:
            if self.fast is not None:
                for r in request_ids:
                    self.fast.release(r)
            return sum(self._ctx.pop(r, None) is not None for r in request_ids)
