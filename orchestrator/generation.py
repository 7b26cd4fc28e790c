"""The speculative round loop (protobuf-free, torch-free): open → [draft → verify → walk]* → release.

Round r: the drafter proposes a tree rooted at the pending bonus token from the context
features of the tokens committed in round r−1; the target verifies it in one forward and
returns one sample per node; this loop runs the acceptance walk (``modeling.acceptance``,
sample-and-match), emits the accepted drafts and the bonus one by one through ``OutputStream``
(so stops inside a step end the output exactly where plain decoding would), and sends the
accepted path back to the target as the commit riding on the next verify. Features are opaque
here: handed from the target's reply to the drafter untouched. Autoregressive mode verifies a
tree made of the root alone (no drafter call); so does a speculative round whose draft block
would pass the drafter's context (output identical to autoregressive).

Round shapes come from the process's ``orchestrator.adaptive.BudgetPlanner``: a request whose
``budget_policy`` is "adaptive" (tree mode) takes, round by round, a one-token round (no draft
call) or a tree of at most its ``tree_budget`` nodes (sent as the draft's ``round_budget``;
both workers keep the budget bound at open as the cap), as the planner's joint plan over all
live requests says; every other request keeps its mode's shape. Any shape is lossless
(sample-and-match accepts exactly the target's own samples), so the policy changes speed only.

The drafter is optional for correctness: when the draft service is down, fails or misses
its per-round deadline, the round is a one-token round (counted in ``fallback_rounds``) and
the request goes on; a new draft session opens once the service is healthy again
(``orchestrator.fallback``), fed the request's last feature rows (``orchestrator.features``).
A target failure ends the request with the target's error. The client's deadline
(``GenerationRequest.deadline``) becomes each worker session's deadline; on an error, a
cancellation or the deadline both sessions are cancelled, so each worker frees the request
at once (a prefill stops between chunks).
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

import structlog

from modeling import acceptance
from modeling.tokenizer import TextTokenizer
from orchestrator.adaptive import CPU_COSTS, BudgetPlanner
from orchestrator.budget import ONE_TOKEN
from orchestrator.fallback import DraftHealth
from orchestrator.features import FeatureTail
from orchestrator.stopping import OutputStream
from protocol.types import FailedPrecondition, Mode, Prefilled, ResourceExhausted, SamplingParams, Verified

log = structlog.get_logger()


class TargetClient(Protocol):
    """``timeout``: seconds the request's session may live (None: no deadline). ``release``
    ends the session and returns once the worker freed it; ``abort=True`` cancels it instead
    (the worker frees the request at once, a prefill stops between chunks)."""

    async def prefill(self, request_id: str, prompt: list[int], max_new_tokens: int, sampling: SamplingParams,
                      mode: Mode, tree_budget: int, timeout: float | None = None, hold: bool = False) -> Prefilled: ...
    # hold: the target keeps the prompt's feature rows (``Prefilled.features`` None), as a held verify's;
    # passed only when True
    async def verify(self, request_id: str, tokens: list[int], parents: list[int],
                     commit: list[int] | None, hold: bool = False) -> Verified: ...
    # hold: the target keeps this round's feature rows (the next verify without it returns them first,
    # ``Verified.held_rows``); passed only when True
    async def release(self, request_id: str, abort: bool = False) -> None: ...


class DraftClient(Protocol):
    """As ``TargetClient``; ``timeout`` is used by the call that opens the session."""
    max_context: int  # positions the drafter holds per request
    block_size: int   # draft block B: a draft at committed length p needs p + B <= max_context

    async def draft(self, request_id: str, features: Any, context_start: int, bonus: int,
                    mode: Mode, tree_budget: int, timeout: float | None = None,
                    round_budget: int | None = None) -> tuple[list[int], list[int]]: ...
    # round_budget: this round's tree budget (<= tree_budget); passed only by adaptive requests
    async def release(self, request_id: str, abort: bool = False) -> None: ...


@dataclass
class GenerationRequest:
    """``request_id`` is the client's (logs, final message); workers see ``worker_id``, unique
    per request, so a reused client id can never touch another request's worker state."""

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int
    mode: Mode = Mode.TREE
    tree_budget: int = 32
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    sampling: SamplingParams = SamplingParams()
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    deadline: float | None = None  # time.monotonic() when the client gives up (its gRPC deadline); None = never
    budget_policy: str = "fixed"  # "adaptive": tree rounds of <= tree_budget nodes or one-token rounds, per round

    def __post_init__(self):
        self.mode = Mode(self.mode)

    def remaining(self) -> float | None:
        """Seconds left before the deadline (>= 0), None without one."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


@dataclass
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class SpecStats:
    rounds: int = 0
    histogram: list[int] = field(default_factory=list)  # index k = rounds emitting k tokens
    expected_accepted: float = 0.0  # sum over rounds of sum_v P_target(path to v)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    fallback_rounds: int = 0  # one-token rounds because the draft service was down, failed or too slow

    def record(self, emitted: int, expected: float) -> None:
        """One round that emitted ``emitted`` tokens (accepted drafts + bonus, cut at a stop)."""
        if len(self.histogram) <= emitted:
            self.histogram.extend([0] * (emitted + 1 - len(self.histogram)))
        self.histogram[emitted] += 1
        self.rounds += 1
        self.expected_accepted += expected

    @property
    def mean_accept_length(self) -> float:
        """τ: tokens emitted per target verify forward (accepted drafts + 1, cut at a stop)."""
        return sum(k * n for k, n in enumerate(self.histogram)) / self.rounds if self.rounds else 0.0

    @property
    def expected_accept_length(self) -> float:
        return 1.0 + self.expected_accepted / self.rounds if self.rounds else 0.0


@dataclass
class Finished:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    stats: SpecStats


class _DraftLink:
    """One request's link to the drafter: its draft session (a new one after a failure, with
    a new worker id so that the old one's release can never touch it) and the request's last
    feature rows, replayed to a new session. Drafter positions count from the session's first
    row: ``base`` is that row's committed position (0 unless the session was re-opened)."""

    def __init__(self, req: GenerationRequest, client: DraftClient, health: DraftHealth, tree_budget: int):
        self.req, self.client, self.health, self.tree_budget = req, client, health, tree_budget
        self.tail = FeatureTail(health.replay_rows)
        self.session: str | None = None
        self.opened = 0   # sessions opened so far
        self.base = 0     # committed position of the session's row 0
        self.held = 0     # rows the session holds
        self.epoch = 0    # the health epoch the session was opened in
        self.full = False  # a draft block would pass the drafter's context: one-token rounds to the end
        self.target_held = 0  # committed rows whose features the target holds for us (held verifies, a held open)
        self.prompt_held = 0  # of them, the prompt's (an open that held them)
        self.abandoned = False  # the drafter missed half of the request's remaining deadline: fall back to the end

    async def propose(self, committed: int, bonus: int,
                      round_budget: int | None = None) -> tuple[list[int], list[int]] | None:
        """A draft tree (tokens, parents) rooted at ``bonus`` given ``committed`` tokens, or None
        when the draft service is down, fails or misses the round deadline (a fallback round).
        ``round_budget``: this round's tree budget (None: the bound one). The rows committed
        since the last draft (several rounds' after one-token rounds) go with it; when they are
        more than the kept tail, the session is re-opened on the tail (as after a fallback).
        Raises only what the request's own deadline or cancellation raise."""
        if self.abandoned or not await self.health.usable():
            await self.drop()
            return None
        if self.session is not None and committed - self.base - self.held > self.tail.rows:
            await self.drop()
        if self.session is None:  # (re-)open: replay the kept rows, numbered from 0
            self.base, self.held = committed - min(self.tail.rows, committed), 0
        new, pos = committed - self.base - self.held, committed - self.base
        if pos + self.client.block_size > self.client.max_context:
            self.full = True
            await self.drop()
            return ([bonus], [-1])
        first = self.session is None
        if first:
            self.opened += 1
            self.session, self.epoch = f"{self.req.worker_id}.d{self.opened}", self.health.epoch
        kw = {} if round_budget is None else {"round_budget": round_budget}
        call = self.client.draft(self.session, self.tail.last(new), self.held, bonus, self.req.mode, self.tree_budget,
                                 timeout=self.req.remaining() if first else None, **kw)
        # a draft may take the round deadline, or half of what is left of the request's own deadline
        limit, left = self.health.round_timeout, self.req.remaining()
        own = left is not None and (limit is None or left / 2 < limit)
        try:
            tokens, parents = await _within(call, left / 2 if own else limit)
        except Exception as e:
            if own and isinstance(e, TimeoutError):
                # too slow for this request's deadline (the drafter may be fine): one-token rounds
                # to its end, without declaring an outage for every request; if the deadline itself
                # is (nearly) gone, the next verify's gRPC deadline reports it
                self.abandoned = True
            elif _exhausted(e):
                # the drafter is full (sessions, contexts or its pool) — healthy, just busy: this
                # request goes on with one-token rounds; the others keep their drafts
                log.info("drafter full: this request goes on without drafts", reason=_describe(e))
                self.abandoned = True
            else:
                left = self.req.remaining()
                if left is not None and left < 0.05:  # the request's own deadline, not the drafter's fault
                    raise
                self.health.failed(self.epoch, _describe(e))
            await self.drop()
            return None
        self.health.succeeded()
        self.held = pos
        return tokens, parents

    async def drop(self, abort: bool = True) -> None:
        """End the live session (cancel it unless ``abort`` is False); errors are logged."""
        session, self.session = self.session, None
        if session is not None:
            try:
                await self.client.release(session, abort=abort)
            except Exception as e:
                log.warning("draft release failed", error=str(e))


async def _within(aw, seconds: float | None):
    """``await aw``, raising TimeoutError after ``seconds`` (None: no limit)."""
    if not seconds:
        return await aw
    if hasattr(asyncio, "timeout"):  # Python >= 3.11: no extra task per call (wait_for makes one)
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)


def _exhausted(e: Exception) -> bool:
    """The drafter refused for want of room (RESOURCE_EXHAUSTED over gRPC, or the engine's own
    ``ResourceExhausted`` through the in-process transport)."""
    code = getattr(e, "code", None)
    return isinstance(e, ResourceExhausted) or getattr(code() if callable(code) else None, "name", "") == "RESOURCE_EXHAUSTED"


def _describe(e: Exception) -> str:
    details = getattr(e, "details", None)  # a gRPC error's own message
    text = details() if callable(details) else str(e)
    return f"{type(e).__name__}: {text or 'no reply within the round deadline'}"


async def generate(req: GenerationRequest, tokenizer: TextTokenizer, target: TargetClient,
                   draft: DraftClient | None, health: DraftHealth | None = None,
                   planner: BudgetPlanner | None = None) -> AsyncIterator[Delta | Finished]:
    """Yield text deltas then one ``Finished``. Releases the request on both workers at the
    end, on error and on cancellation. ``health``: the process's shared view of the draft
    service (``orchestrator.fallback``; a fresh one if None). ``planner``: the process's round
    shape planner (``orchestrator.adaptive``; a private one on the CPU cost table if None).
    Raises what the target raises
    (a dead target: its gRPC error at once) and FailedPrecondition if the target's feature rows
    are not the walked path (a protocol error)."""
    speculative = req.mode.speculative
    out = OutputStream(tokenizer, req.stop, req.stop_token_ids, req.max_tokens)
    stats = SpecStats()
    link, finished, ticket, drafting, done = None, False, None, None, False
    planner = planner or BudgetPlanner(CPU_COSTS)
    try:
        tree_budget = 0
        if speculative:  # a chain is the drafter's block minus its bonus slot
            tree_budget = req.tree_budget if req.mode is Mode.TREE else draft.block_size - 1
            link = _DraftLink(req, draft, health or DraftHealth(), tree_budget)
        adaptive = req.budget_policy == "adaptive" and req.mode is Mode.TREE
        ticket = planner.join(req.mode, tree_budget, adaptive, draft.block_size if req.mode is Mode.CHAIN else None)
        # a request that joins a one-token plan leaves its prompt's feature rows with the target too: they
        # reach the drafter only if drafting resumes before it ends (the first verify without hold fetches them)
        hold = link is not None and planner.holds(ticket)
        pre = await target.prefill(req.worker_id, req.prompt_tokens, req.max_tokens, req.sampling, req.mode,
                                   tree_budget, timeout=req.remaining(), **_HOLD if hold else {})
        bonus, commit = pre.first_token, None
        committed = len(req.prompt_tokens)
        if hold and pre.features is None:  # (a target that predates TargetOpen.hold_features sends them: not held)
            link.target_held = link.prompt_held = committed
        elif link:
            link.tail.add(pre.features)
        emit, expected = [bonus], None  # the round's tokens not yet pushed, and its expected accepted drafts
        while True:
            # the next round's draft goes out before this round's tokens are pushed and streamed, so the
            # drafter works while they are detokenized, stop-checked and written to the client; not when
            # they surely end the output (max_tokens, a stop token id). A stop string found while pushing
            # wastes that one draft (awaited at the end, never emitted); its session ends as usual.
            # Only while few requests are live (OVERLAP_MAX_LIVE): under load the event loop is busy with the
            # other requests anyway, so the overlap saves no time there and costs a task per round.
            shape = drafting = None
            overlap = len(planner.live) <= OVERLAP_MAX_LIVE
            if overlap and not out.ends_within(emit):
                shape = planner.next_shape(ticket)
                if link and not link.full and shape.drafts and not link.target_held:
                    drafting = _start(_timed(link.propose(committed, bonus, shape.nodes if adaptive else None)))
                    if not _EAGER:
                        await asyncio.sleep(0)  # (Python < 3.12: let it send before the tokens are pushed)
            emitted = 0
            for tok in emit:
                emitted += 1
                if out.push(tok):
                    done = True
                    break
            if expected is not None:
                stats.record(emitted, expected)
            text, ids = out.take_delta()
            if text or ids:
                yield Delta(text, ids)
            if done:
                break
            proposal, drafted = None, False
            if not overlap:  # the draft asked for now, after the round's tokens went out (no task)
                shape = planner.next_shape(ticket)
                if link and not link.full and shape.drafts and not link.target_held:
                    drafting = _timed(link.propose(committed, bonus, shape.nodes if adaptive else None))
            if drafting is not None:
                pending, drafting = drafting, None  # (a cancel of this request cancels it too)
                proposal, seconds = await pending
                if link.full:  # (a block past the drafter's context was never asked for)
                    planner.fix(ticket, ONE_TOKEN)
                else:
                    stats.draft_seconds += seconds
                    drafted = proposal is not None
                stats.fallback_rounds += proposal is None
            tokens, parents = proposal or ([bonus], [-1])
            # a one-token round of a one-token plan leaves its feature rows with the target (they are needed only
            # once drafting resumes; the wire, the worker's and this loop's work for them is a one-token round's
            # largest cost beyond an autoregressive one's); a round that should draft while rows are held
            # fetches them instead, as a one-token round, and drafting resumes the round after
            # (rounds hold up to the replay tail's rows beyond a prompt's; without limit once the drafter's
            # context is full: never fetched, the target keeps the newest MAX_HELD_ROWS)
            hold = (link is not None and not shape.drafts and planner.holds(ticket)
                    and (link.full or link.target_held - link.prompt_held < link.tail.keep))
            if planner.defer and planner.claim_maintain():  # runs once this task waits for the verify (sent by then)
                asyncio.get_running_loop().call_soon(planner.maintain)
            t0 = time.perf_counter()
            v = await target.verify(req.worker_id, tokens, parents, commit, **_HOLD if hold else {})
            stats.verify_seconds += time.perf_counter() - t0
            path, bonus = acceptance.resolve(tokens, parents, v.samples)
            if speculative and v.feature_nodes != path:
                raise FailedPrecondition(f"target sent features of nodes {v.feature_nodes[:8]}, "
                                         f"the accepted path is {path[:8]}")
            emit = [tokens[i] for i in path[1:]]
            emit.append(bonus)
            expected = acceptance.expected_accepted(v.edge_probs, parents)
            planner.observe(ticket, shape if drafted else ONE_TOKEN, expected if drafted else None)
            commit, committed = path, committed + len(path)
            if hold and v.features is None:  # (a target that predates hold_features sends the rows: not held)
                link.target_held += len(path)
            elif link:
                if v.held_rows != link.target_held:  # the target kept only the newest: the tail would have a gap
                    link.tail.clear()
                link.target_held = link.prompt_held = 0
                if not link.full:
                    link.tail.add(v.features)
        finished = True
        yield Finished(out.finish_reason, len(req.prompt_tokens), len(out.token_ids), stats)
    finally:
        # finished: end the sessions (returns once the workers freed them); otherwise cancel them.
        # Shielded: a client that cancels while the target's release is awaited must not skip the
        # drafter's (a leaked draft session otherwise). A draft still in flight (the one a stop string
        # wasted) is awaited first when finished, so its session ends cleanly; otherwise cancelled.
        if drafting is not None and not finished:
            drafting.cancel()

        async def release_both():
            try:
                await target.release(req.worker_id, abort=not finished)
            except Exception as e:  # a dead worker frees its state anyway
                log.warning("release failed", error=str(e))
            if drafting is not None:
                await asyncio.wait([drafting])
                if not drafting.cancelled() and drafting.exception() is not None:
                    log.info("wasted draft failed", error=str(drafting.exception()))
            if link:
                await link.drop(abort=not finished or (drafting is not None and drafting.cancelled()))

        if ticket is not None:
            planner.leave(ticket)
        await asyncio.shield(release_both())


#: the next round's draft overlaps this round's emission only while at most this many requests are live
#: in the process (the planner's count); SPECDEC_DRAFT_OVERLAP_MAX_LIVE (0: never, as before 8ade7f6)
OVERLAP_MAX_LIVE = int(os.environ.get("SPECDEC_DRAFT_OVERLAP_MAX_LIVE", "1000000"))

_HOLD = {"hold": True}  # (passed only when holding: TargetClients written before hold need not take it)

#: Python >= 3.12 starts a task eagerly (it runs up to its first wait before ``_start`` returns)
_EAGER = sys.version_info >= (3, 12)


def _start(coro) -> asyncio.Task:
    """A task running ``coro``, started at once where Python allows (``_EAGER``)."""
    if _EAGER:
        return asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)  # (3.12.1 needs the loop)
    return asyncio.ensure_future(coro)


async def _timed(aw):
    """(``await aw``, seconds it took)."""
    t0 = time.perf_counter()
    result = await aw
    return result, time.perf_counter() - t0
