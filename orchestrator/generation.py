"""The speculative round loop (protobuf-free): prefill → [draft → verify+commit]* → release.

Round r: the drafter proposes a tree rooted at the pending bonus token from the context
features of the tokens committed in round r−1; the target verifies it in one forward, resolves
the accepted path (sample-and-match), commits it and samples the next bonus token. The tokens
emitted this round are the accepted drafts followed by the bonus; they are pushed one by one
through ``OutputStream`` so stops inside a step end the output exactly where plain decoding
would. Autoregressive mode verifies a tree made of the root alone (no drafter call).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

import structlog
import torch

from modeling.results import PrefillOutput, VerifyOutput
from modeling.sampling import SamplingParams
from modeling.tokenizer import TextTokenizer
from orchestrator.stopping import OutputStream

MODES = ("autoregressive", "chain", "tree")
log = structlog.get_logger()


class TargetClient(Protocol):
    async def prefill(self, request_id: str, prompt: list[int], max_new_tokens: int,
                      sampling: SamplingParams, return_features: bool) -> PrefillOutput: ...
    async def verify(self, request_id: str, tokens: list[int], parents: list[int],
                     sampling: SamplingParams, return_features: bool) -> VerifyOutput: ...
    async def release(self, request_id: str) -> None: ...


class DraftClient(Protocol):
    async def draft(self, request_id: str, features: torch.Tensor, context_start: int, bonus: int,
                    mode: str, budget: int) -> tuple[list[int], list[int]]: ...
    async def release(self, request_id: str) -> None: ...


@dataclass
class GenerationRequest:
    """``request_id`` is the client's (logs, final message); workers see ``worker_id``, unique
    per request, so a reused client id can never touch another request's worker state."""

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int
    mode: str = "tree"
    budget: int = 32
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] = field(default_factory=set)
    sampling: SamplingParams = SamplingParams()
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class SpecStats:
    rounds: int = 0
    histogram: list[int] = field(default_factory=list)  # index k = rounds committing k tokens
    expected_accepted: float = 0.0  # sum over rounds of sum_v P_target(path to v)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(self, committed: int, expected: float) -> None:
        if len(self.histogram) <= committed:
            self.histogram.extend([0] * (committed + 1 - len(self.histogram)))
        self.histogram[committed] += 1
        self.rounds += 1
        self.expected_accepted += expected

    @property
    def mean_accept_length(self) -> float:
        """τ: tokens committed per target verify forward (accepted drafts + 1)."""
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
    end, on error and on cancellation."""
    speculative = req.mode != "autoregressive"
    out = OutputStream(tokenizer, req.stop, req.stop_token_ids, req.max_tokens)
    stats = SpecStats()
    try:
        pre = await target.prefill(req.worker_id, req.prompt_tokens, req.max_tokens, req.sampling, speculative)
        bonus, features, context_start = pre.first_token, pre.features, 0
        done = out.push(bonus)
        while True:
            text, ids = out.take_delta()
            if text or ids:
                yield Delta(text, ids)
            if done:
                break
            if speculative:
                t0 = time.perf_counter()
                tokens, parents = await draft.draft(req.worker_id, features, context_start, bonus,
                                                    req.mode, req.budget)
                stats.draft_seconds += time.perf_counter() - t0
                context_start += features.shape[0]
            else:
                tokens, parents = [bonus], [-1]
            t0 = time.perf_counter()
            v = await target.verify(req.worker_id, tokens, parents, req.sampling, speculative)
            stats.verify_seconds += time.perf_counter() - t0
            stats.record(len(v.accepted_nodes), v.expected_accepted)
            bonus, features = v.bonus_token, v.features
            for tok in [tokens[i] for i in v.accepted_nodes[1:]] + [bonus]:
                if out.push(tok):
                    done = True
                    break
        yield Finished(out.finish_reason, len(req.prompt_tokens), len(out.token_ids), stats)
    finally:
        for worker in (target, draft if speculative else None):
            if worker is not None:
                try:
                    await worker.release(req.worker_id)
                except Exception as e:  # a dead worker frees its state anyway
                    log.warning("release failed", error=str(e))
