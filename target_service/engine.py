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
from modeling.kv_cache import KVCache
from modeling.llama import LlamaModel, causal_mask, tree_mask
from modeling.results import PrefillOutput, VerifyOutput
from modeling.sampling import SamplingParams, processed_logprobs, sample


@dataclass
class _Request:
    cache: KVCache
    bonus: int


def tree_structure(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """depths [N+1] int64 and visibility [N+1, N+1] bool from parents [N+1] (parents[0] = -1,
    parents[i] < i). Visibility[i, j]: j is i or an ancestor of i."""
    n = parents.shape[0]
    depths = torch.zeros(n, dtype=torch.int64)
    vis = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):  # parents precede children
        p = int(parents[i])
        depths[i] = depths[p] + 1
        vis[i] |= vis[p]
    return depths, vis


class TargetEngine:
    """Serves one target model. Thread-safe (one forward at a time).

    Args: model (on its device), taps (ascending decoder-layer indices whose outputs form the
    context features), max_context (tokens), kv_pool_tokens (sum of KV rows reserved by live
    requests), max_tree_nodes (non-root nodes per verify).
    """

    def __init__(self, model: LlamaModel, taps: tuple[int, ...], max_context: int,
                 kv_pool_tokens: int, max_tree_nodes: int = 512):
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
            cache = self.model.new_cache(capacity)
            T = len(prompt)
            tokens = torch.tensor(prompt, dtype=torch.int64, device=self.device)
            pos = torch.arange(T, device=self.device)
            hidden, feats = self.model(tokens, pos, cache, causal_mask(0, T, self.device), self.taps)
            cache.length = T
            first = int(sample(self.model.logits(hidden[-1:]), params, pos[-1:] + 1)[0])
            if self._released_early.pop(request_id, False) is None:
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
            par = torch.tensor(parents, dtype=torch.int64)
            depths, vis = tree_structure(par)
            tok = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            par, depths, vis = par.to(self.device), depths.to(self.device), vis.to(self.device)
            pos = L + depths
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

    def release(self, request_ids: list[str]) -> int:
        """Free the requests' KV. An unknown id is remembered (bounded) so that a prefill still
        queued for it keeps nothing. Returns how many were freed."""
        with self._lock:
            freed = 0
            for r in request_ids:
                if self._requests.pop(r, None) is not None:
                    freed += 1
                else:
                    self._released_early[r] = None
                    while len(self._released_early) > 4096:
                        self._released_early.popitem(last=False)
            return freed
