"""Worker clients wrapped to feed the orchestrator's Prometheus metrics (``serving.metrics``)
without touching the round loop: each draft and verify call is timed into
``specdec:round_phase_seconds``, each draft counts one draft and its tree nodes. The walk and
everything else the orchestrator does per round is the rest of ``inter_token_latency``; the
wire share of a call is its phase time minus the worker's ``specdec:worker_op_seconds``."""
from __future__ import annotations

from orchestrator.generation import DraftClient, SpecStats, TargetClient
from serving import metrics

_children: dict = {}


def _child(family, label: str):
    """``family.labels(label)``, looked up once per process (a child appears on /metrics at its first use, as
    before): ``labels()`` per call was ~5 µs of the orchestrator's Python per round at c = 64 on the H200
    (py-spy, bench/results/concurrency_h200_s27_gap.json)."""
    child = _children.get((family, label))
    if child is None:
        child = _children[(family, label)] = family.labels(label)
    return child


class MeteredTarget:
    def __init__(self, target: TargetClient):
        self.target = target

    async def prefill(self, *args, **kw):
        with _child(metrics.ROUND_SECONDS, "prefill").time():
            return await self.target.prefill(*args, **kw)

    async def verify(self, *args, **kw):
        with _child(metrics.ROUND_SECONDS, "verify").time():
            return await self.target.verify(*args, **kw)

    async def release(self, request_id: str, abort: bool = False) -> None:
        await self.target.release(request_id, abort)


class MeteredDraft:
    def __init__(self, draft: DraftClient):
        self.draft_client = draft

    @property
    def max_context(self) -> int:
        return self.draft_client.max_context

    @property
    def block_size(self) -> int:
        return self.draft_client.block_size

    async def draft(self, *args, **kw):
        with _child(metrics.ROUND_SECONDS, "draft").time():
            tokens, parents = await self.draft_client.draft(*args, **kw)
        metrics.NUM_DRAFTS.inc()
        metrics.NUM_DRAFT_TOKENS.inc(len(tokens) - 1)  # the root is the bonus token, not a draft
        return tokens, parents

    async def release(self, request_id: str, abort: bool = False) -> None:
        await self.draft_client.release(request_id, abort)


_totals = {"rounds": 0, "accepted": 0, "expected": 0.0}


def record_finished(stats: SpecStats, speculative: bool) -> None:
    """Per-round accept lengths of a finished request; τ gauges over speculative requests."""
    for k, n in enumerate(stats.histogram):
        for _ in range(n):
            metrics.ACCEPT_LENGTH.observe(k)
    accepted = sum((k - 1) * n for k, n in enumerate(stats.histogram) if k)
    metrics.NUM_ACCEPTED_TOKENS.inc(accepted)
    if speculative and stats.rounds:
        _totals["rounds"] += stats.rounds
        _totals["accepted"] += accepted
        _totals["expected"] += stats.expected_accepted
        _child(metrics.TAU, "realised").set(1 + _totals["accepted"] / _totals["rounds"])
        _child(metrics.TAU, "expected").set(1 + _totals["expected"] / _totals["rounds"])
