"""Target engine: per-request KV, tree verification and commit. Free of gRPC/protobuf.

A request is opened by ``prefill``, which binds its sampling params, mode and tree budget
(plans/0004). ``verify`` follows DDTree/SpecInfer tree attention: one forward over
[root, nodes…] at positions prefix_len + depth with attention to every committed row plus the
tree's visibility (ancestor) mask, then one target sample per node (and each node's edge
probability). It does not decide acceptance: the orchestrator walks the samples and sends the
accepted path back as ``commit`` with the next verify; the tree's rows stay pending until then
(commit = accepted rows gathered into place, the rest dropped; on the GPU fast path the rows
of a path of ≤ 16 move inside the next verify's forward, and the samples, edge probabilities
and the path's features come back in one device → host copy).

``verify_batch`` verifies several requests' trees at once (issue 14, continuous batching):
each item is validated on its own (a refused item changes nothing and gets its exception),
then on the GPU fast path all valid items' trees run as ONE forward (rows concatenated, per-row
request metadata, every commit's KV moves in the same launch). The kernels are row-invariant
and samples are keyed by (seed, position), so each item's result equals its solo ``verify``
bit for bit. ``verify`` is a batch of one.

Prefill is chunked under a step token budget (issue 14 §5): a prompt is queued and its chunks
ride in the steps — each ``verify_batch`` carries, after its trees, chunks of queued prompts in
what is left of ``step_tokens`` rows; when no request is live or the live ones leave the engine
idle, the prefilling thread runs prefill-only steps itself — so running streams wait at most
one step for a long prompt.

KV: on the GPU fast path every request's rows live in one ``PagedKVPool`` (pages of 128 rows, a
free list, a page table per request; issue 14, plans/0009 §3): admission reserves a request's
whole budget (prompt + max_new_tokens + tree_budget + 1 rows, rounded up to pages) at once, so a
running request never waits for a page and nothing is preempted; a request that fits the empty
pool waits for pages, one that never fits is refused. Tree rows beyond the committed path stay
inside the request's own pages (reused by its next tree). The CPU path (fast="off") keeps one
stand-alone ``KVCache`` per request (counted in rows).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from modeling import acceptance
from modeling.kv_cache import PAGE_ROWS, KVCache, PagedCache, PagedKVPool
from modeling.llama import LlamaModel, causal_mask, tree_mask
from modeling.sampling import filtered, processed_logprobs, sample, sampling_words
from modeling.tree import tree_ancestors, visibility
from protocol.types import (FailedPrecondition, InvalidRequest, Mode, Prefilled, ResourceExhausted, SamplingParams,
                            UnknownRequest, Verified)


@dataclass
class _Pending:
    """The last verified tree, its rows written after the committed ones, not yet committed."""
    tokens: list[int]
    parents: list[int]
    samples: list[int]


@dataclass
class _Request:
    cache: KVCache | PagedCache
    bonus: int              # the pending bonus token: the next tree's root
    params: SamplingParams  # bound at prefill
    speculative: bool       # mode != autoregressive: features are returned
    tree_budget: int        # non-root nodes per tree (0 in autoregressive mode)
    pending: _Pending | None = None
    held: list = field(default_factory=list)  # feature rows of held rounds (CPU [n, taps·H] parts), oldest first
    held_rows: int = 0


def _hold(req: _Request, rows: torch.Tensor) -> None:
    """Keep ``rows`` ([n, taps·H], CPU, owned) after the request's held rows, for the next verify
    that does not hold; the newest ``MAX_HELD_ROWS`` stay."""
    req.held.append(rows)
    req.held_rows += rows.shape[0]
    while req.held_rows > MAX_HELD_ROWS:
        excess, first = req.held_rows - MAX_HELD_ROWS, req.held[0]
        if first.shape[0] <= excess:
            req.held.pop(0)
            req.held_rows -= first.shape[0]
        else:
            req.held[0], req.held_rows = first[excess:].clone(), req.held_rows - excess


@dataclass
class VerifyItem:
    """One request's verify in ``TargetEngine.verify_batch``: its tree (flat, root = the pending
    bonus token; see ``TargetEngine.verify``) and the previous tree's accepted path."""
    request_id: str
    tokens: list[int]
    parents: list[int]
    commit: list[int] | None = None
    hold: bool = False      # keep this round's feature rows here (returned first by the next verify without it)


@dataclass
class _Work:
    """A validated item whose commit is applied: what its tree's forward needs."""
    index: int              # position in the batch
    req: _Request
    tokens: list[int]
    parents: list[int]
    L: int                  # committed length after the commit (the tree's first position)
    moves: list[tuple[int, int]]  # fast path: the commit's KV moves (absolute pool rows)
    hold: bool = False
    depths: np.ndarray | None = None
    anc: np.ndarray | None = None


@dataclass
class _Prefill:
    """A prompt queued for prefill: steps run its chunks until ``finished`` (``error`` set when it
    stopped early). ``feats``: per-chunk features [n, taps·H] on the device (speculative modes);
    ``last``: the logits [1, V] float32 of the prompt's last row once its last chunk ran."""
    request_id: str
    prompt: list[int]
    cache: KVCache | PagedCache
    speculative: bool
    done: int = 0  # prompt rows already in the KV
    feats: list = field(default_factory=list)
    last: torch.Tensor | None = None
    error: BaseException | None = None
    finished: bool = False


@dataclass
class _Chunk:
    """Prompt rows [c0, c1) of a queued prefill, run in this step as a chain (each row's
    ancestors: every earlier row of the prompt)."""
    job: _Prefill
    c0: int
    c1: int

    @property
    def tokens(self) -> list[int]:
        return self.job.prompt[self.c0:self.c1]


ITEM_ERRORS = (UnknownRequest, InvalidRequest, FailedPrecondition, ResourceExhausted)
#: feature rows a request's held open and verifies keep at most (``hold``; the newest): 1024 rows of the default
#: target's 3 taps × 576 in bf16 are 3.5 MB per request (the orchestrator holds at most its replay tail's rows,
#: 256 by default, beyond a prompt's)
MAX_HELD_ROWS = 1024


def tree_structure(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """depths [N+1] int64 and visibility [N+1, N+1] bool from parents [N+1] (parents[0] = -1,
    parents[i] < i). Visibility[i, j]: j is i or an ancestor of i."""
    depths, anc = tree_ancestors(parents.numpy())
    return torch.from_numpy(depths), torch.from_numpy(visibility(depths, anc))


class TargetEngine:
    """Serves one target model. Thread-safe (one forward at a time).

    Args: model (on its device), taps (ascending decoder-layer indices whose outputs form the
    context features), max_context (tokens), kv_pool_tokens (sum of KV rows reserved by live
    requests), max_tree_budget (non-root nodes per verify), fast ("off": the eager torch
    forward, the CPU path; "eager": the row-invariant Triton forward over one device-wide
    ``PagedKVPool`` of kv_pool_tokens rows in pages of ``kv_page_rows`` (128; small pages in
    tests only); "graphs": the same, replayed from CUDA graphs captured
    per tree-size bucket at construction), prefill_chunk (the smallest prompt chunk a step
    carries, rows; on the CPU path every chunk is a whole number of these pieces, each its own
    forward), step_tokens (the step token budget: rows of one step, decode rows first, then
    prefill chunks; 0 = no budget; see ``prefill``), max_batch (fast path: most requests' trees
    in one forward of ``verify_batch``) and max_forward_rows (fast path: most rows of one
    forward, the largest graph bucket; default max_tree_budget + 1). A batch with more items or
    rows runs as several forwards, each holding whole trees (in item order).

    ``step_log``: (decode rows, prefill rows, prompts queued for prefill as it began) of the
    last 1024 steps (a step = one ``verify_batch`` or one prefill-only step), for tests and
    benches.
    """

    def __init__(self, model: LlamaModel, taps: tuple[int, ...], max_context: int,
                 kv_pool_tokens: int, max_tree_budget: int = 512, fast: str = "off", prefill_chunk: int = 64,
                 max_batch: int = 64, max_forward_rows: int | None = None, kv_page_rows: int = PAGE_ROWS,
                 step_tokens: int = 512):
        if prefill_chunk < 1 or step_tokens < 0:
            raise ValueError(f"prefill_chunk must be >= 1 and step_tokens >= 0, got {prefill_chunk}, {step_tokens}")
        self.model = model
        self.taps = tuple(taps)
        self.max_context = max_context
        self.kv_pool_tokens = kv_pool_tokens
        self.max_tree_budget = max_tree_budget
        self.device = model.lm_head.weight.device
        self.vocab_size = model.cfg.vocab_size
        self._requests: dict[str, _Request] = {}
        self._released_early: OrderedDict[str, None] = OrderedDict()  # released before prefill ran
        self._lock = threading.Lock()        # request state and KV pool (short sections)
        self._model_lock = threading.Lock()  # one forward at a time; taken before _lock, never after
        self._room = threading.Condition(self._lock)  # notified when KV rows are freed
        self._reserved = 0  # KV rows held by live and prefilling requests
        self._prefilling: dict[str, bool] = {}  # request_id → released while its prefill runs
        self._queue: list[_Prefill] = []  # prompts waiting for chunks, oldest first (under _lock)
        self._verifies_waiting = 0  # verify_batch calls waiting for the model lock (under _lock)
        self._steps, self._step_seconds = 0, 0.0  # steps run; their recent mean duration (s)
        self._turn = threading.Condition(self._lock)  # notified when a verify gets the model, a step or a prefill ends
        self.prefill_chunk, self.step_tokens = prefill_chunk, step_tokens
        self.step_log: deque[tuple[int, int, int]] = deque(maxlen=1024)
        self.fast, self.pool, self._tree_forward = fast, None, None
        self._max_moves = 0  # fast path: a commit of ≤ this many rows runs inside the next forward
        if fast != "off":
            from specdec_kernels.kv_commit import MAX_MOVES
            from modeling.fast_forward import RowInvariantLlama
            from modeling.graphs import EagerVerify, VerifyGraphs

            c = model.cfg
            if isinstance(model, LlamaModel):
                self.pool = PagedKVPool(c.num_hidden_layers, kv_pool_tokens, c.num_key_value_heads, c.head_dim,
                                        self.device, model.lm_head.weight.dtype, kv_page_rows)
                forward = RowInvariantLlama(model, self.pool, self.taps)
            else:  # DeepSeek-V3 / Kimi-K2 (already switched by row_invariant_): a paged MLA latent pool
                from modeling.mla_batch import RowInvariantDeepseek

                args = (c.num_hidden_layers, kv_pool_tokens, 1, c.kv_lora_rank + c.qk_rope_head_dim, self.device,
                        model.lm_head.weight.dtype, kv_page_rows)
                if hasattr(model, "row_invariant_forward"):  # modeling.tp.TPDriver: the same on every rank
                    if fast == "graphs":
                        raise ValueError("a tensor-parallel target runs the fast path eagerly (fast='eager'): "
                                         "its inputs reach the other ranks through the host")
                    self.pool, forward = model.row_invariant_forward(args, self.taps, max_context + max_tree_budget + 1)
                else:
                    self.pool = PagedKVPool(*args, latent=True)
                    forward = RowInvariantDeepseek(model, self.pool, self.taps, max_context + max_tree_budget + 1)
            self._max_moves = MAX_MOVES
            rows = max(max_tree_budget + 1, max_forward_rows or 0)
            if fast == "graphs":
                self._tree_forward = VerifyGraphs(forward, rows, self.device, max_batch)
                self._tree_forward.capture()
            else:
                self._tree_forward = EagerVerify(forward, rows, self.device, max_batch)

    @property
    def reserved_tokens(self) -> int:
        """KV rows reserved by live requests and prefills under way (fast path: their pages'
        rows)."""
        return self._reserved

    @property
    def live_requests(self) -> int:
        return len(self._requests)

    def _features(self, feats: torch.Tensor | None, rows=None) -> torch.Tensor | None:
        if feats is None:
            return None
        return (feats if rows is None else feats[rows]).cpu()

    @torch.inference_mode()
    def prefill(self, request_id: str, prompt: list[int], max_new_tokens: int, params: SamplingParams,
                mode: str = "autoregressive", tree_budget: int = 0, wait_seconds: float | None = None,
                hold: bool = False) -> Prefilled:
        """Open a request: bind sampling params, mode and tree budget, run the prompt, commit
        its KV, sample the first token (the pending bonus, not in the KV). KV reserved:
        prompt + max_new_tokens + tree_budget + 1 rows (fast path: rounded up to whole pages,
        taken at once). Features [T, taps·H] (CPU) are returned
        in speculative modes — or, with ``hold``, kept here as held rows (the newest
        ``MAX_HELD_ROWS``; ``features`` None): the first verify without ``hold`` returns them
        first, as a held verify's (``verify``).

        Chunked prefill under the step token budget (issue 14, plans/0009 §5): the prompt is
        queued and runs in chunks, each chunk an item of a *step* — one ``verify_batch`` (its
        decode rows first, then the chunks of queued prompts, oldest first, in what is left of
        ``step_tokens``, at least ``prefill_chunk`` rows for the oldest prompt so it always
        advances) or a prefill-only step this thread runs itself (chunks of up to
        ``step_tokens`` rows) when no verify waits for the model and either no request is live
        or none has run a step for as long as a step takes (``_await_turn``). So a running
        stream's verify waits at most one step and its own step holds at most max(step_tokens,
        its decode rows + prefill_chunk) rows, while a long prompt's first token comes later
        under load. On the fast path a chunk is a chain (row j's ancestors: rows 0…j; at most
        max_forward_rows rows) in the same row-invariant forward as the verify trees; on the CPU
        path a chunk is whole pieces of ``prefill_chunk`` rows, each its own eager forward (the
        pieces do not depend on the load: the eager forward is not row-invariant). Either way
        the KV, features and first token are bitwise those of the request's solo run. A
        ``release`` that arrives meanwhile stops it before its next chunk (UnknownRequest) and
        frees its KV.

        Admission: a request that would fit the empty pool but finds too few free rows now waits
        up to ``wait_seconds`` (None or 0: not at all, today's behaviour) for other requests to
        free theirs; a ``release`` of its id meanwhile ends the wait (UnknownRequest).

        Raises InvalidRequest (empty/over-long prompt, bad ids, duplicate id, bad params, mode
        or tree budget), ResourceExhausted (the request can never fit the pool: the message
        names prompt_tokens, max_new_tokens and kv_pool_tokens; or the pool stayed full for
        wait_seconds), UnknownRequest (released while waiting or during the prefill)."""
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
        if mode not in Mode._value2member_map_:
            raise InvalidRequest(f"mode must be one of {[m.value for m in Mode]}, got {mode!r}")
        speculative = Mode(mode).speculative
        if speculative and not 1 <= tree_budget <= self.max_tree_budget:
            raise InvalidRequest(f"tree_budget must be in [1, {self.max_tree_budget}], got {tree_budget}")
        tree_budget = tree_budget if speculative else 0
        capacity = len(prompt) + max_new_tokens + tree_budget + 1
        if capacity > self.kv_pool_tokens:
            raise ResourceExhausted(
                f"request can never fit the KV pool: prompt_tokens ({len(prompt)}) + max_new_tokens "
                f"({max_new_tokens}) + tree_budget ({tree_budget}) + 1 = {capacity} rows > kv_pool_tokens "
                f"{self.kv_pool_tokens}")
        with self._lock:
            cache = self._admit(request_id, capacity, wait_seconds)
            self._prefilling[request_id] = self._released_early.pop(request_id, False) is None
            job = _Prefill(request_id, list(prompt), cache, speculative)
            self._queue.append(job)
        try:
            while self._await_turn(job):
                with self._model_lock:
                    if not job.finished:
                        self._step([], [])
            if job.error is not None:
                raise job.error
            pos = torch.tensor([len(prompt)], device=self.device)
            first = int(sample(job.last, params, pos)[0])
            feats = torch.cat(job.feats).cpu() if speculative and job.feats else None
        except BaseException:
            with self._lock:
                if job in self._queue:
                    self._queue.remove(job)
                del self._prefilling[request_id]
                self._free(cache)
            raise
        with self._lock:
            if self._prefilling.pop(request_id):
                self._free(cache)
                return Prefilled(first, None)  # its caller already gave up: keep nothing
            req = self._requests[request_id] = _Request(cache, first, params, speculative, tree_budget)
            if hold and feats is not None:
                _hold(req, feats)
                feats = None
        return Prefilled(first, feats)

    def _await_turn(self, job: _Prefill) -> bool:
        """Wait until ``job`` is finished (False) or a prefill-only step may run (True): no
        verify waits for the model, and no request is live or none has run a step for as long as
        a step takes (an average of recent steps): live requests' steps carry the chunks, and a
        decode stream meets at most one prefill-only step between two of its own."""
        with self._lock:
            idle = False
            while not job.finished:
                if not self._verifies_waiting and (idle or not self._requests):
                    return True
                seen = self._steps
                self._turn.wait(max(self._step_seconds, 1e-3))
                idle = self._steps == seen
            return False

    def verify(self, request_id: str, tokens: list[int], parents: list[int],
               commit: list[int] | None = None, hold: bool = False) -> Verified:
        """Commit the previous tree's accepted path (``commit``: its node indices from the root,
        as the orchestrator's walk decided; required after every verify but the first), then
        run the forward over this tree and sample every node with the request's bound params.

        tokens/parents: flat tree rooted at the pending bonus token (the last sample on the
        committed path), index 0 = root, parents[0] = -1, parents[i] in [0, i), siblings with
        distinct tokens. Returns ``Verified``; its features (CPU, speculative modes) are those
        of the sample-consistent path (``modeling.acceptance.resolve``), the rows the next
        commit keeps — after the rows earlier verifies held (``held_rows`` of them, oldest first).
        ``hold``: keep this verify's rows here instead (its ``features`` None; at most the newest
        ``MAX_HELD_ROWS`` are kept). Nothing changes if an argument is refused. Raises UnknownRequest,
        InvalidRequest, FailedPrecondition, ResourceExhausted. A batch of one of
        ``verify_batch``."""
        out = self.verify_batch([VerifyItem(request_id, tokens, parents, commit, hold)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    @torch.inference_mode()
    def verify_batch(self, items: list[VerifyItem]) -> list[Verified | Exception]:
        """``verify`` for several requests at once: per item its ``Verified`` or the exception
        ``verify`` would raise for it (UnknownRequest, InvalidRequest, FailedPrecondition,
        ResourceExhausted; a request id already earlier in the batch: FailedPrecondition). Each
        item is validated on its own before anything runs; a refused item changes nothing.
        On the fast path the valid items' trees run in one forward (several when they exceed
        max_batch trees or max_forward_rows rows); on the CPU path one forward per item. Each
        item's result equals what ``verify`` alone returns for it. The call is a step: queued
        prompts' prefill chunks follow the trees in it (see ``prefill``)."""
        results: list[Verified | Exception | None] = [None] * len(items)
        with self._lock:
            self._verifies_waiting += 1  # queued prefills yield the model to this call
        try:
            self._model_lock.acquire()
        finally:
            with self._lock:
                self._verifies_waiting -= 1
                self._turn.notify_all()
        try:
            work = self._prepare(items, results)
            self._step(work, results)
        finally:
            self._model_lock.release()
        return results

    def _step(self, work: list[_Work], results: list) -> None:
        """One step (``_model_lock`` held): the trees of ``work`` (results into ``results``),
        then chunks of queued prompts in what is left of the step token budget. A prompt
        released meanwhile leaves the queue with UnknownRequest; if the forward raises, every
        prompt with a chunk in this step gets the error too (its thread re-raises it)."""
        t0 = time.perf_counter()
        for w in work:  # (released meanwhile: its rows are only reused by a forward after this one)
            w.depths, w.anc = tree_ancestors(w.parents)
        decode = sum(len(w.tokens) for w in work)
        with self._lock:
            queued = len(self._queue)
            chunks = self._plan(decode)
        try:
            if self._tree_forward is None:
                for w in work:
                    results[w.index] = self._verify_eager(w)
                for c in chunks:
                    self._chunk_eager(c)
            else:
                for forward in self._chunks(work + chunks):
                    with self._lock:  # a prompt released meanwhile stops at this chunk boundary
                        forward = [x for x in forward if not (isinstance(x, _Chunk) and self._stopped(x.job))]
                    if forward:
                        self._verify_fast(forward, results)
        except BaseException as e:
            with self._lock:
                for c in chunks:
                    self._end_prefill(c.job, e)
            raise
        finally:
            self.step_log.append((decode, sum(c.c1 - c.c0 for c in chunks), queued))
        with self._lock:
            for c in chunks:
                if c.c1 == len(c.job.prompt):
                    self._end_prefill(c.job)
            dt = time.perf_counter() - t0
            self._steps += 1
            self._step_seconds = dt if self._steps == 1 else 0.8 * self._step_seconds + 0.2 * dt
            self._turn.notify_all()  # prefills waiting for a step see it ran

    def _plan(self, decode_rows: int) -> list[_Chunk]:
        """This step's prefill chunks (``_lock`` held): queued prompts oldest first, each from
        where it stopped, filling step_tokens − decode_rows rows (the oldest prompt at least
        prefill_chunk rows; no budget: whole prompts). CPU: whole pieces of prefill_chunk rows
        (a prompt's last piece may be shorter); fast path: a prompt's rows of the step cut into
        chunks of ≤ max_forward_rows (one forward each at most)."""
        left = (self.step_tokens or 1 << 62) - decode_rows
        P, out = self.prefill_chunk, []
        R = self._tree_forward.inputs.R if self._tree_forward is not None else 1 << 62
        for job in list(self._queue):
            if self._stopped(job):
                continue
            rest = len(job.prompt) - job.done
            n = left if out else max(left, P)
            if self._tree_forward is None and n < rest:
                n = n // P * P
            n = min(n, rest)
            if n <= 0:
                break
            out += [_Chunk(job, c0, min(c0 + R, job.done + n)) for c0 in range(job.done, job.done + n, R)]
            left -= n
        return out

    def _stopped(self, job: _Prefill) -> bool:
        """Whether ``job`` is over; one released meanwhile ends here with UnknownRequest
        (``_lock`` held)."""
        if not job.finished and self._prefilling.get(job.request_id):
            self._end_prefill(job, UnknownRequest(f"request_id {job.request_id!r} was released during its "
                                                  f"prefill (after {job.done} of {len(job.prompt)} prompt tokens)"))
        return job.finished

    def _end_prefill(self, job: _Prefill, error: BaseException | None = None) -> None:
        """A queued prompt is done (all chunks ran) or stopped with ``error`` (``_lock`` held)."""
        if job.finished:
            return
        job.error, job.finished = error, True
        if job in self._queue:
            self._queue.remove(job)
        self._turn.notify_all()

    def _chunk_eager(self, c: _Chunk) -> None:
        """The CPU path: a chunk as pieces of prefill_chunk rows, each an eager causal forward
        over the request's own cache."""
        job, P = c.job, self.prefill_chunk
        for p0 in range(c.c0, c.c1, P):
            with self._lock:  # a prompt released meanwhile stops at this piece boundary
                if self._stopped(job):
                    return
            p1 = min(c.c1, p0 + P)
            tokens = torch.tensor(job.prompt[p0:p1], dtype=torch.int64, device=self.device)
            pos = torch.arange(p0, p1, device=self.device)
            hidden, f = self.model(tokens, pos, job.cache, causal_mask(p0, p1 - p0, self.device), self.taps)
            self._chunk_ran(job, p1, hidden[-1:], f)

    def _chunk_ran(self, job: _Prefill, end: int, last: torch.Tensor, feats: torch.Tensor | None) -> None:
        """Rows up to ``end`` of the prompt are in the KV; ``last``: the last row's hidden state
        [1, H] (CPU path) or logits [1, V] (fast path; views of the forward's buffers: copied
        here); feats: the chunk's features [n, F] or None."""
        job.cache.length = job.done = end
        if job.speculative and feats is not None:
            job.feats.append(feats.clone())
        if end == len(job.prompt):
            job.last = self.model.logits(last) if self._tree_forward is None else last.clone()

    def _prepare(self, items: list[VerifyItem], results: list) -> list[_Work]:
        """Validate each item (its exception into ``results``), then apply its commit: the
        accepted rows are committed (on the fast path a path of ≤ MAX_MOVES rows as KV moves of
        the coming forward) and the pending bonus becomes the tree's root."""
        work, seen = [], set()
        with self._lock:  # request state only: a release never waits for the forward
            for k, it in enumerate(items):
                try:
                    if it.request_id in seen:
                        raise FailedPrecondition(f"request_id {it.request_id!r} appears more than once "
                                                 "in one verify batch")
                    seen.add(it.request_id)
                    req = self._requests.get(it.request_id)
                    if req is None:
                        raise UnknownRequest(f"request_id {it.request_id!r} is not live on the target")
                    path, bonus = self._check_commit(req, it.commit)
                    self._check_tree(req, it.tokens, it.parents, bonus)
                    cache, n = req.cache, len(it.tokens)
                    L = cache.length + len(path)
                    if L + n > cache.capacity:
                        raise ResourceExhausted(f"tree of {n} rows at prefix {L} exceeds the request's KV "
                                                f"capacity {cache.capacity}")
                except ITEM_ERRORS as e:
                    results[k] = e
                    continue
                moves = []
                if path:
                    if len(path) <= self._max_moves:
                        moves = cache.move_rows(path)  # rows moved by the forward, on the device
                        cache.length += len(path)
                    else:
                        cache.commit(torch.tensor(path, dtype=torch.int64))
                    req.bonus, req.pending = bonus, None
                work.append(_Work(k, req, list(it.tokens), list(it.parents), L, moves, it.hold))
        return work

    def _chunks(self, work: list[_Work | _Chunk]):
        """The fast path's forwards: whole trees (and prefill chunks) in order, ≤ max_batch trees
        and ≤ the forward's rows each."""
        R, B = self._tree_forward.inputs.R, self._tree_forward.max_trees
        chunk, rows = [], 0
        for w in work:
            n = len(w.tokens)
            if chunk and (rows + n > R or len(chunk) == B):
                yield chunk
                chunk, rows = [], 0
            chunk.append(w)
            rows += n
        if chunk:
            yield chunk

    def _done(self, w: _Work, samples: list[int], edge: list[float] | None, rows: list[int] | None = None,
              path_feats=None, feats=None) -> Verified:
        """Record the pending tree and build the item's result. edge None = greedy (an edge is
        whether the parent's argmax picks the node); rows = the walked path (walked here when
        None); path_feats = that path's features (CPU), or feats = all rows' features to gather
        them from."""
        tokens, parents = w.tokens, w.parents
        if edge is None:
            edge = [1.0] + [float(tokens[v] == samples[parents[v]]) for v in range(1, len(tokens))]
        else:
            edge[0] = 1.0
        w.req.pending = _Pending(tokens, parents, samples)
        if rows is None:
            rows, _ = acceptance.resolve(tokens, parents, samples)
        if not w.req.speculative or (path_feats is None and feats is None):
            return Verified(samples, edge, [], None)
        if path_feats is None:
            path_feats = self._features(feats, torch.tensor(rows, device=feats.device))
        req = w.req
        if w.hold:
            _hold(req, path_feats.clone())  # (a view of the batch's gathered rows would keep all of them alive)
            return Verified(samples, edge, rows, None)
        if req.held:
            held, n = req.held, req.held_rows
            req.held, req.held_rows = [], 0
            return Verified(samples, edge, rows, torch.cat(held + [path_feats]), n)
        return Verified(samples, edge, rows, path_feats)

    def _verify_eager(self, w: _Work) -> Verified:
        """The CPU path: the eager torch forward over one request's tree, its own KV cache."""
        params, L, n = w.req.params, w.L, len(w.tokens)
        vis = torch.from_numpy(visibility(w.depths, w.anc)).to(self.device)
        pos = L + torch.from_numpy(w.depths).to(self.device)
        tok = torch.tensor(w.tokens, dtype=torch.int64, device=self.device)
        hidden, feats = self.model(tok, pos, w.req.cache, tree_mask(L, vis), self.taps)
        logits = self.model.logits(hidden)
        if params.greedy:
            return self._done(w, logits.argmax(-1).tolist(), None, feats=feats)
        par = torch.tensor(w.parents, dtype=torch.int64, device=self.device).clamp(min=0)
        lp = processed_logprobs(logits, params)
        # P(node's token) under its parent's distribution (lp[v] is the law after v)
        edge = lp[par].gather(-1, tok[:, None]).squeeze(-1).exp()
        out = torch.stack([sample(logits, params, pos + 1, lp).double(), edge]).tolist()
        return self._done(w, [int(x) for x in out[0]], out[1], feats=feats)

    def _verify_fast(self, chunk: list[_Work | _Chunk], results: list) -> None:
        """One forward over the chunk's trees and prefill chunks (the row-invariant Triton
        forward, a graph replay with "graphs"); results into ``results``, each prefill chunk's
        last logits and features into its ``_Prefill``. A chunk of one tree walks its path on the
        device and copies its result back once; a larger chunk copies every row's sample back
        once, walks on the host and gathers the paths' features in one copy."""
        from modeling.graphs import TreeRows

        fwd = self._tree_forward
        rows = []
        for w in chunk:
            if isinstance(w, _Chunk):  # a prefill chunk: a chain at positions c0…c1−1
                n = w.c1 - w.c0
                chain = np.tril(np.broadcast_to(np.arange(n, dtype=np.int32), (n, n)))
                rows.append(TreeRows(w.tokens, np.arange(n), chain, w.job.cache.base, w.c0))
            else:
                rows.append(TreeRows(w.tokens, w.depths, w.anc, w.req.cache.base, w.L,
                                     None if w.req.params.greedy else sampling_words(w.req.params), w.moves))
        fwd.batch(rows)
        for k, w in enumerate(chunk):
            if isinstance(w, _Chunk):
                r0, r1 = fwd.spans[k]
                self._chunk_ran(w.job, w.c1, fwd.logits[r1 - 1:r1], None if fwd.feats is None else fwd.feats[r0:r1])
        trees = [k for k, w in enumerate(chunk) if isinstance(w, _Work)]
        if not trees:
            return
        if len(chunk) == 1:
            w = chunk[0]
            params, spec = w.req.params, w.req.speculative
            if params.greedy:
                samples, edge, end, end_depth, path_feats = fwd.greedy(spec)
            else:
                samples, edge, end, end_depth, path_feats = fwd.sampled(filtered(params), spec)
            rows, _ = acceptance.resolve(w.tokens, w.parents, samples)
            if path_feats is not None and rows[-1] == end and len(rows) == end_depth + 1:
                path_feats = path_feats[:len(rows)].clone()
            else:
                path_feats = None
            results[w.index] = self._done(w, samples, edge, rows, path_feats, fwd.feats)
            return
        sampled = {k: filtered(chunk[k].req.params) for k in trees if not chunk[k].req.params.greedy}
        samples, edges = fwd.batch_samples(sampled)
        walked, gather = {}, []
        for k in trees:
            w = chunk[k]
            r0, r1 = fwd.spans[k]
            rows, _ = acceptance.resolve(w.tokens, w.parents, samples[r0:r1])
            walked[k] = rows
            if w.req.speculative and fwd.feats is not None:
                gather += [r0 + r for r in rows]
        feats = fwd.path_features(gather) if gather else None
        at = 0
        for k in trees:
            w = chunk[k]
            r0, r1 = fwd.spans[k]
            rows, path_feats = walked[k], None
            if w.req.speculative and feats is not None:
                path_feats, at = feats[at:at + len(rows)], at + len(rows)
            edge = edges[r0:r1] if k in sampled else None
            results[w.index] = self._done(w, samples[r0:r1], edge, rows, path_feats)

    def _check_commit(self, req: _Request, commit: list[int] | None) -> tuple[list[int], int]:
        """(path, new pending bonus) of a commit of the pending tree; ([], bonus) without one."""
        p = req.pending
        if p is None:
            if commit:
                raise FailedPrecondition("commit given but no verified tree is pending")
            return [], req.bonus
        if not commit:
            raise FailedPrecondition("commit of the previous tree's accepted path is required")
        if commit[0] != 0 or any(not 0 < b < len(p.tokens) or p.parents[b] != a for a, b in zip(commit, commit[1:])):
            raise InvalidRequest(f"commit must be a root path of the pending tree of {len(p.tokens)} nodes, "
                                 f"got {commit[:8]}")
        return list(commit), p.samples[commit[-1]]

    def _check_tree(self, req: _Request, tokens: list[int], parents: list[int], bonus: int) -> None:
        n = len(tokens)
        if n < 1 or len(parents) != n:
            raise InvalidRequest(f"tree.tokens and tree.parents must have the same length >= 1, "
                                 f"got {n} and {len(parents)}")
        if n - 1 > req.tree_budget:
            raise InvalidRequest(f"tree has {n - 1} nodes; the request's tree_budget is {req.tree_budget}")
        if parents[0] != -1:
            raise InvalidRequest("tree.parents[0] must be -1 (the root)")
        if tokens[0] != bonus:
            raise FailedPrecondition(f"tree.tokens[0] must be the pending bonus token {bonus}, got {tokens[0]}")
        seen = set()
        for i in range(1, n):
            if not 0 <= parents[i] < i:
                raise InvalidRequest(f"tree.parents[{i}] must be in [0, {i}), got {parents[i]}")
            if not 0 <= tokens[i] < self.vocab_size:
                raise InvalidRequest(f"tree.tokens[{i}] must be in [0, {self.vocab_size}), got {tokens[i]}")
            if (parents[i], tokens[i]) in seen:
                raise InvalidRequest(f"tree.tokens[{i}] repeats a sibling's token {tokens[i]}")
            seen.add((parents[i], tokens[i]))

    def _admit(self, request_id: str, capacity: int, wait_seconds: float | None) -> KVCache | PagedCache:
        """Reserve ``capacity`` KV rows (≤ kv_pool_tokens) for a new request — on the fast
        path its pages, all at once — waiting up to wait_seconds for room. Called with
        ``_lock`` held."""
        deadline = time.monotonic() + (wait_seconds or 0.0)
        while True:
            if request_id in self._requests or request_id in self._prefilling:
                raise InvalidRequest(f"request_id {request_id!r} is already live")
            if self.pool is not None:
                need, free = self.pool.pages_for(capacity), self.pool.free_pages
                if need <= free:
                    cache = self.pool.allocate(capacity)
                    self._reserved += cache.rows_held
                    return cache
                why = (f"KV pool full: request needs {capacity} rows = {need} pages of {self.pool.page_rows}, "
                       f"{free} of {self.pool.pages} pages (kv_pool_tokens {self.kv_pool_tokens}) free")
            elif capacity <= self.kv_pool_tokens - self._reserved:
                self._reserved += capacity
                return self.model.new_cache(capacity)
            else:
                free = self.kv_pool_tokens - self._reserved
                why = f"KV pool full: request needs {capacity} rows, {free} of kv_pool_tokens {self.kv_pool_tokens} free"
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResourceExhausted(why + (f" (waited {wait_seconds:g} s)" if wait_seconds else ""))
            self._room.wait(min(left, threading.TIMEOUT_MAX))  # a huge wait_seconds overflows wait()
            if request_id in self._released_early:  # its caller gave up while it waited
                del self._released_early[request_id]
                raise UnknownRequest(f"request_id {request_id!r} was released while waiting for KV rows")

    def _free(self, cache: KVCache | PagedCache) -> None:
        """Return a request's KV rows (``_lock`` held) and wake prefills waiting for room."""
        if self.pool is not None:
            self.pool.free(cache)
        self._reserved -= cache.rows_held
        self._room.notify_all()

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
                elif r in self._prefilling:  # its prefill stops at the next chunk and frees the KV
                    self._prefilling[r] = True
                else:
                    self._released_early[r] = None
                    while len(self._released_early) > 4096:
                        self._released_early.popitem(last=False)
                    self._room.notify_all()  # a prefill of r may be waiting for KV rows
            return freed
