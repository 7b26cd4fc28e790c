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
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

import structlog

from modeling import acceptance
from modeling.tokenizer import TextTokenizer
from orchestrator.stopping import OutputStream
from protocol.types import FailedPrecondition, Mode, Prefilled, SamplingParams, Verified

log = structlog.get_logger()


class TargetClient(Protocol):
    async def prefill(self, request_id: str, prompt: list[int], max_new_tokens: int, sampling: SamplingParams,
                      mode: Mode, tree_budget: int) -> Prefilled: ...
    async def verify(self, request_id: str, tokens: list[int], parents: list[int],
                     commit: list[int] | None) -> Verified: ...
    async def release(self, request_id: str) -> None: ...


class DraftClient(Protocol):
    max_context: int  # positions the drafter holds per request
    block_size: int   # draft block B: a draft at committed length p needs p + B <= max_context

    async def draft(self, request_id: str, features: Any, context_start: int, bonus: int,
                    mode: Mode, tree_budget: int) -> tuple[list[int], list[int]]: ...
    async def release(self, request_id: str) -> None: ...


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

    def __post_init__(self):
        self.mode = Mode(self.mode)


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


async def generate(req: GenerationRequest, tokenizer: TextTokenizer, target: TargetClient,
                   draft: DraftClient | None) -> AsyncIterator[Delta | Finished]:
    """Yield text deltas then one ``Finished``. Releases the request on both workers at the
    end, on error and on cancellation. Raises FailedPrecondition if the target's feature rows
    are not the walked path (a protocol error)."""
    speculative = req.mode.speculative
    out = OutputStream(tokenizer, req.stop, req.stop_token_ids, req.max_tokens)
    stats = SpecStats()
    try:
        tree_budget = 0
        if speculative:  # a chain is the drafter's block minus its bonus slot
            tree_budget = req.tree_budget if req.mode is Mode.TREE else draft.block_size - 1
        pre = await target.prefill(req.worker_id, req.prompt_tokens, req.max_tokens, req.sampling, req.mode,
                                   tree_budget)
        bonus, features, commit = pre.first_token, pre.features, None
        committed, context_start = len(req.prompt_tokens), 0  # committed tokens; drafter context length
        drafting = speculative
        done = out.push(bonus)
        while True:
            text, ids = out.take_delta()
            if text or ids:
                yield Delta(text, ids)
            if done:
                break
            drafting = drafting and committed + draft.block_size <= draft.max_context
            if drafting:
                t0 = time.perf_counter()
                tokens, parents = await draft.draft(req.worker_id, features, context_start, bonus, req.mode,
                                                    tree_budget)
                stats.draft_seconds += time.perf_counter() - t0
                context_start = committed
            else:  # autoregressive, or the draft block would pass the drafter's context
                tokens, parents = [bonus], [-1]
            t0 = time.perf_counter()
            v = await target.verify(req.worker_id, tokens, parents, commit)
            stats.verify_seconds += time.perf_counter() - t0
            path, bonus = acceptance.resolve(tokens, parents, v.samples)
            if speculative and v.feature_nodes != path:
                raise FailedPrecondition(f"target sent features of nodes {v.feature_nodes[:8]}, "
                                         f"the accepted path is {path[:8]}")
            emitted = 0
            for tok in [tokens[i] for i in path[1:]] + [bonus]:
                emitted += 1
                if out.push(tok):
                    done = True
                    break
            stats.record(emitted, acceptance.expected_accepted(v.edge_probs, parents))
            commit, features, committed = path, v.features, committed + len(path)
        yield Finished(out.finish_reason, len(req.prompt_tokens), len(out.token_ids), stats)
    finally:
        for worker in (target, draft if speculative else None):
            if worker is not None:
                try:
                    await worker.release(req.worker_id)
                except Exception as e:  # a dead worker frees its state anyway
                    log.warning("release failed", error=str(e))
