"""Draft engine: per-request drafter context (KV injection) and tree building. Free of gRPC.

A request's first call binds its mode (chain | tree) and tree budget (plans/0004); later
calls carry only the new context features and the bonus token.
Per call: append the context K/V rows of tokens committed since the last call, run the block
[bonus, MASK×(B−1)] at positions p…p+B−1 (p = committed length), take the target LM head's
logits at slots 1…B−1 as the drafter's distributions at depths 1…B−1, and build a chain
(top-1 path) or a DDTree under the budget.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from draft_service.ddtree import build_chain, build_ddtree
from modeling.dflash import DFlashDrafter
from protocol.types import FailedPrecondition, InvalidRequest, ResourceExhausted

MODES = ("chain", "tree")


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
    (live request contexts), name (for GetInfo). Thread-safe (one forward at a time)."""

    def __init__(self, drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor,
                 max_tree_budget: int = 512, max_context: int = 8192, max_requests: int = 256,
                 name: str = "dflash", fast: str = "off", context_pool_tokens: int = 1 << 16):
        self.drafter, self.name = drafter, name
        self.cfg = drafter.config
        self.embed, self.lm_head = embed, lm_head
        self.device, self.dtype = embed.device, embed.dtype
        self.max_tree_budget, self.max_context, self.max_requests = max_tree_budget, max_context, max_requests
        self.feature_width = len(self.cfg.target_layer_ids) * self.cfg.hidden_size
        self._ctx: dict[str, _Context] = {}
        self._lock = threading.Lock()
        # fast: "off" (eager torch, per-request tensors; CPU) | "eager" | "graphs" (GPU: context
        # rows in one pool of context_pool_tokens rows, block + tree build from CUDA graphs)
        self.fast = None
        if fast != "off":
            from draft_service.fast_draft import GraphedDrafter

            self.fast = GraphedDrafter(drafter, embed, lm_head, context_pool_tokens, max_tree_budget, fast == "graphs")

    @property
    def live_requests(self) -> int:
        return len(self._ctx)

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
                    raise ResourceExhausted(f"drafter context pool full: {e}") from None
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

    @torch.inference_mode()
    def draft(self, request_id: str, features: torch.Tensor, context_start: int, bonus: int,
              mode: str | None = None, budget: int | None = None) -> tuple[list[int], list[int]]:
        """Append context features [n, taps·H] (positions context_start…) and draft a tree
        rooted at ``bonus``. Returns (tokens, parents) flat, index 0 = root. ``mode`` and
        ``budget`` (the tree budget) are bound by the request's first call (context_start 0)
        and may be left out later.

        Raises InvalidRequest (field + limit), FailedPrecondition (context out of sync),
        ResourceExhausted (too many live contexts)."""
        c = self.cfg
        if request_id not in self._ctx:
            self._check_mode(mode, budget)
        if features.dim() != 2 or features.shape[1] != self.feature_width:
            raise InvalidRequest(f"context_features must be [n, {self.feature_width}], got {list(features.shape)}")
        if not 0 <= bonus < c.vocab_size:
            raise InvalidRequest(f"bonus_token must be in [0, {c.vocab_size}), got {bonus}")
        n = features.shape[0]
        p = context_start + n
        if p + c.block_size > self.max_context:
            raise InvalidRequest(f"position {p} + block_size {c.block_size} exceeds max_context {self.max_context}")
        with self._lock:
            ctx = self._context(request_id, context_start, n, mode, budget)
            if self.fast is not None:
                try:
                    out = self.fast.draft(request_id, features, bonus, ctx.mode, ctx.tree_budget)
                except MemoryError as e:
                    raise ResourceExhausted(f"drafter context pool full: {e}") from None
                ctx.length = p
                return out
            if n:
                pos = torch.arange(ctx.length, p, device=self.device)
                for i, (k, v) in enumerate(self.drafter.context_kv(features.to(self.device, self.dtype), pos)):
                    ctx.k[i, ctx.length:p] = k
                    ctx.v[i, ctx.length:p] = v
                ctx.length = p
            block = torch.full((c.block_size,), c.mask_token_id, dtype=torch.int64, device=self.device)
            block[0] = bonus
            kv = [(ctx.k[i, :p], ctx.v[i, :p]) for i in range(c.num_hidden_layers)]
            hidden = self.drafter(self.embed[block], torch.arange(p, p + c.block_size, device=self.device), kv)
            logits = (hidden[1:] @ self.lm_head.T).float()[None]  # [1, B-1, V]
            root = torch.tensor([bonus], device=self.device)
            tree = build_chain(logits, root)[0] if ctx.mode == "chain" else build_ddtree(logits, root, ctx.tree_budget)[0]
            return tree.tokens.tolist(), tree.parents.tolist()

    def release(self, request_ids: list[str]) -> int:
        """Drop the requests' drafter contexts; unknown ids are ignored."""
        with self._lock:
            if self.fast is not None:
                for r in request_ids:
                    self.fast.release(r)
            return sum(self._ctx.pop(r, None) is not None for r in request_ids)
