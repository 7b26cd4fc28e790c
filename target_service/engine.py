"""Target engine: per-request KV, tree verification and commit. Free of gRPC/protobuf.

Verify follows DDTree/SpecInfer tree attention: one forward over [root, nodes…] at positions
prefix_len + depth with attention to every committed row plus the tree's visibility
(ancestor) mask; then sample-and-match acceptance on the logits' device, and commit of the
accepted rows (gathered into place; the rest dropped).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from modeling import acceptance
from modeling.errors import FailedPrecondition, InvalidRequest, ResourceExhausted, UnknownRequest
from modeling.kv_cache import KVCache, KVPool
from modeling.llama import LlamaModel, causal_mask, tree_mask
from modeling.results import PrefillOutput, VerifyOutput
from modeling.sampling import SamplingParams, processed_logprobs, sample
from modeling.tree import tree_ancestors, visibility


@dataclass
class _Request:
    cache: KVCache
    bonus: int


def tree_structure(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """depths [N+1] int64 and visibility [N+1, N+1] bool from parents [N+1] (parents[0] = -1,
    parents[i] < i). Visibility[i, j]: j is i or an ancestor of i."""
    depths, anc = tree_ancestors(parents.numpy())
    return torch.from_numpy(depths), torch.from_numpy(visibility(depths, anc))


class TargetEngine:
    """Serves one target model. Thread-safe (one forward at a time).

    Args: model (on its device), taps (ascending decoder-layer indices whose outputs form the
    context features), max_context (tokens), kv_pool_tokens (sum of KV rows reserved by live
    requests), max_tree_nodes (non-root nodes per verify), fast ("off": the eager torch
    forward, the CPU path; "eager": the row-invariant Triton forward over one device-wide
    ``KVPool`` of kv_pool_tokens rows; "graphs": the same, replayed from CUDA graphs captured
    per tree-size bucket at construction).
    """

    def __init__(self, model: LlamaModel, taps: tuple[int, ...], max_context: int,
                 kv_pool_tokens: int, max_tree_nodes: int = 512, fast: str = "off"):
        self.model = model
        self.taps = tuple(taps)
        self.max_context = max_context
        self.kv_pool_tokens = kv_pool_tokens
        self.max_tree_nodes = max_tree_nodes
        self.device = model.lm_head.weight.device
        self.vocab_size = model.cfg.vocab_size
        self._requests: dict[str, _Request] = {}
        self._released_early: OrderedDict[str, None] = OrderedDict()  # released before prefill ran
        self._lock = threading.Lock()
        self.fast, self.pool, self._tree_forward = fast, None, None
        if fast != "off":
            from modeling.fast_forward import RowInvariantLlama
            from modeling.graphs import VerifyGraphs

            c = model.cfg
            self.pool = KVPool(c.num_hidden_layers, kv_pool_tokens, c.num_key_value_heads, c.head_dim,
                               self.device, model.lm_head.weight.dtype)
            self._tree_forward = RowInvariantLlama(model, self.pool, self.taps)
            if fast == "graphs":
                self._tree_forward = VerifyGraphs(self._tree_forward, max_tree_nodes + 1, self.device)
                self._tree_forward.capture()

    @property
    def reserved_tokens(self) -> int:
        return sum(r.cache.capacity for r in self._requests.values())

    @property
    def live_requests(self) -> int:
        return len(self._requests)

    def _features(self, feats: torch.Tensor | None, rows=None) -> torch.Tensor | None:
        if feats is None:
            return None
        return (feats if rows is None else feats[rows]).cpu()

    @torch.inference_mode()
    def prefill(self, request_id: str, prompt: list[int], max_new_tokens: int,
                params: SamplingParams, return_features: bool = True) -> PrefillOutput:
        """Run the prompt, commit its KV, sample the first token (pending bonus, not in KV).

        Raises InvalidRequest (empty/over-long prompt, bad ids, duplicate id, bad params),
        ResourceExhausted (KV pool full)."""
        if not prompt:
            raise InvalidRequest("prompt_tokens must not be empty")
        if max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.max_context:
            raise InvalidRequest(f"prompt_tokens ({len(prompt)}) + max_new_tokens ({max_new_tokens}) "
                                 f"must be <= max_context {self.max_context}")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt_tokens must be in [0, {self.vocab_size}), got {bad[0]}")
        params.validate(self.vocab_size)
        capacity = len(prompt) + max_new_tokens + self.max_tree_nodes + 1
        with self._lock:
            if request_id in self._requests:
                raise InvalidRequest(f"request_id {request_id!r} is already live")
            if self.reserved_tokens + capacity > self.kv_pool_tokens:
                raise ResourceExhausted(
                    f"KV pool full: request needs {capacity} rows, {self.kv_pool_tokens - self.reserved_tokens} "
                    f"of kv_pool_tokens {self.kv_pool_tokens} free")
            try:
                cache = self.pool.allocate(capacity) if self.pool is not None else self.model.new_cache(capacity)
            except MemoryError as e:
                raise ResourceExhausted(f"KV pool fragmented: {e}") from None
            T = len(prompt)
            tokens = torch.tensor(prompt, dtype=torch.int64, device=self.device)
            pos = torch.arange(T, device=self.device)
            hidden, feats = self.model(tokens, pos, cache, causal_mask(0, T, self.device), self.taps)
            cache.length = T
            first = int(sample(self.model.logits(hidden[-1:]), params, pos[-1:] + 1)[0])
            if self._released_early.pop(request_id, False) is None:
                self._free(cache)
                return PrefillOutput(first, None)  # its caller already gave up: keep nothing
            self._requests[request_id] = _Request(cache, first)
            return PrefillOutput(first, self._features(feats) if return_features else None)

    @torch.inference_mode()
    def verify(self, request_id: str, tokens: list[int], parents: list[int], params: SamplingParams,
               return_features: bool = True) -> VerifyOutput:
        """Verify a tree rooted at the pending bonus token and commit the accepted path.

        tokens/parents: flat tree, index 0 = root, parents[0] = -1, parents[i] in [0, i),
        siblings with distinct tokens. Raises UnknownRequest, InvalidRequest, ResourceExhausted."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise UnknownRequest(f"request_id {request_id!r} is not live on the target")
            self._check_tree(req, tokens, parents)
            params.validate(self.vocab_size)
            cache, L, n = req.cache, req.cache.length, len(tokens)
            if L + n > cache.capacity:
                raise ResourceExhausted(f"tree of {n} rows at prefix {L} exceeds the request's KV "
                                        f"capacity {cache.capacity}")
            depths_np, anc_np = tree_ancestors(parents)
            depths, vis = torch.from_numpy(depths_np), torch.from_numpy(visibility(depths_np, anc_np))
            tok = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            par = torch.tensor(parents, dtype=torch.int64, device=self.device)
            depths, vis = depths.to(self.device), vis.to(self.device)
            pos = L + depths
            if self._tree_forward is not None:
                slots = torch.arange(cache.base + L, cache.base + L + n, device=self.device)
                meta = torch.tensor([cache.base, L], device=self.device)
                logits, feats = self._tree_forward(tok, pos, slots, torch.from_numpy(anc_np).to(self.device), meta)
            else:
                hidden, feats = self.model(tok, pos, cache, tree_mask(L, vis), self.taps)
                logits = self.model.logits(hidden)
            if params.greedy:
                samples = logits.argmax(-1)
                edge = (tok == samples[par.clamp(min=0)]).double()
            else:
                lp = processed_logprobs(logits, params)
                samples = sample(logits, params, pos + 1, lp)
                # P(node's token) under its parent's distribution (lp[v] is the law after v)
                edge = lp[par.clamp(min=0)].gather(-1, tok[:, None]).squeeze(-1).exp()
            path, bonus = acceptance.resolve(tok, par, depths, vis, samples)
            expected = float(acceptance.path_probabilities(edge, par, depths)[1:].sum())
            cache.commit(path)
            req.bonus = bonus
            return VerifyOutput(path.tolist(), bonus, samples.tolist(), expected,
                                self._features(feats, path) if return_features else None)

    def _check_tree(self, req: _Request, tokens: list[int], parents: list[int]) -> None:
        n = len(tokens)
        if n < 1 or len(parents) != n:
            raise InvalidRequest(f"tree.tokens and tree.parents must have the same length >= 1, "
                                 f"got {n} and {len(parents)}")
        if n - 1 > self.max_tree_nodes:
            raise InvalidRequest(f"tree has {n - 1} nodes; max_tree_nodes is {self.max_tree_nodes}")
        if parents[0] != -1:
            raise InvalidRequest("tree.parents[0] must be -1 (the root)")
        if tokens[0] != req.bonus:
            raise FailedPrecondition(f"tree.tokens[0] must be the pending bonus token {req.bonus}, got {tokens[0]}")
        seen = set()
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                raise InvalidRequest(f"tree.parents[{i}] must be in [0, {i}), got {parents[i]}")
            if not 0 <= tokens[i] < self.vocab_size:
                raise InvalidRequest(f"tree.tokens[{i}] must be in [0, {self.vocab_size}), got {tokens[i]}")
            if (parents[i], tokens[i]) in seen:
                raise InvalidRequest(f"tree.tokens[{i}] repeats a sibling's token {tokens[i]}")
            seen.add((parents[i], tokens[i]))

    def _free(self, cache: KVCache) -> None:
        if self.pool is not None:
            self.pool.free(cache)

    def release(self, request_ids: list[str]) -> int:
        """Free the requests' KV. An unknown id is remembered (bounded) so that a prefill still
        queued for it keeps nothing. Returns how many were freed."""
        with self._lock:
            freed = 0
            for r in request_ids:
                req = self._requests.pop(r, None)
                if req is not None:
                    self._free(req.cache)
                    freed += 1
                else:
                    self._released_early[r] = None
                    while len(self._released_early) > 4096:
                        self._released_early.popitem(last=False)
            return freed
