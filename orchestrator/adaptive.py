"""The adaptive tree budget in the serving path (issue 14 item 3, plans/0009 §4): one
``BudgetPlanner`` per orchestrator process gives every live request its next round's shape.

Every request that runs ``generation.generate`` holds a ``Ticket`` from ``join`` until it ends
(``leave``): the live set is the batch the workers' step batchers form. A request whose budget
policy is adaptive (tree mode) may take a one-token round (no draft call: the target verifies
the pending bonus alone; its feature rows reach the drafter with the next draft, as after a
fallback round) or a tree of b ≤ its cap nodes (the ``tree_budget`` both workers bound at
open; the drafter gets b as ``round_budget``). Every other request has a fixed shape —
autoregressive (one-token), chain, or its fixed tree budget — and still counts in the step's
modelled cost.

The joint plan is ``budget.plan_step`` over the live tickets' ``AcceptanceEstimate`` gains and
the process's ``CostModel``; it is cached and recomputed only when the live set changed or an
estimate moved by more than ``drift`` (relative) since the plan, and then at most every
``min_interval`` seconds — or longer, so that planning takes at most ``max_plan_share`` of
the time (the interval after a plan is at least its duration / max_plan_share); a request the
plan does not cover yet (it just joined) takes the shape of a planned request with the same
options and the nearest level until the next plan, and is planned at once only when there is
none (the first request of its kind) — so joins, leaves and drift together never plan more
often than the interval allows (before: every join at ≤ 16 live planned at once, ~27 extra
plans a second at c=16 in a closed loop on the H200's rates). Pure Python, torch-free; runs on
the orchestrator's event loop, the serial part of a round at high concurrency (~0.5 ms per
plan at 16 requests, ~1.8 ms at 64 on the loaded 2-core dev VM; ``python -m
bench.adaptive_overhead`` measures the planner's share per round).

Metrics (prometheus-client, exposed with the orchestrator's families by ``use_metrics``):
``specdec:round_shape_total{shape}`` (rounds by the shape verified: "one-token", "chain@15",
"tree@16", …; a fallback round counts as one-token) and ``specdec:budget_plan_tokens_per_ms``
(the current plan's modelled committed tokens per ms over all live requests).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, fields

from prometheus_client import Counter, Gauge

from orchestrator.budget import (H200_BENCH_ACCEPTED, ONE_TOKEN, AcceptanceEstimate, CostModel, Shape, StepPlan,
                                 chain, evaluate, plan_step, tree)
from protocol.types import Mode

ROUND_SHAPES = Counter("specdec:round_shape", "Rounds by the shape the target verified (one-token, chain@N, tree@N; "
                       "a draft fallback counts as one-token)", ["shape"], registry=None)
PLAN_RATE = Gauge("specdec:budget_plan_tokens_per_ms", "Modelled committed tokens per ms of the current round-shape "
                  "plan over all live requests (orchestrator.budget cost model)", registry=None)

_SHAPE_COUNTERS: dict[Shape, Counter] = {}
POLICIES = ("fixed", "adaptive")


def use_metrics() -> None:
    """Expose this module's families on the process's /metrics (once)."""
    from serving import metrics

    metrics.expose(ROUND_SHAPES, PLAN_RATE)


def load_cost_model(path: str) -> CostModel:
    """A ``CostModel`` from a JSON object of its fields (tables as [[x, ms], …]; other keys,
    e.g. "measured", are ignored) — what ``python -m bench.cost_table`` writes. Raises
    ValueError naming the file on a missing or malformed field."""
    try:
        raw = json.loads(open(path).read())
        names = {f.name for f in fields(CostModel)}
        kw = {k: v for k, v in raw.items() if k in names}
        for k in ("verify_ms", "draft_ms"):
            kw[k] = tuple((int(x), float(ms)) for x, ms in kw[k])
        return CostModel(**kw)
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"cost model {path}: {type(e).__name__}: {e}") from None


# The embedded SmolLM2-135M target (float32) + the shipped drafter on the 2-core dev VM's CPU,
# batch 1, prefix 300, one torch thread, while other jobs shared the machine (2026-12-01 00:26 UTC):
# ``python -m bench.cost_table`` → bench/results/cost_table_cpu.json. Rough. The CPU workers loop
# per request, so a one-row forward is paid per request (host_ms) and verify_ms holds the cost
# above it by rows; each further drafting request costs one more draft call.
CPU_COSTS = CostModel(verify_ms=((1, 9.64), (2, 0.0), (5, 31.43), (17, 116.95), (33, 162.13), (65, 227.96)),
                      chain_draft_ms=42.28, draft_ms=((4, 42.31), (16, 46.82), (64, 47.64)),
                      draft_ms_per_request=42.31, host_ms=61.38,
                      spec_step_ms=1.0, block_size=8)


def default_cost_model(device: str) -> CostModel:
    """``H200_COSTS`` for a target on a CUDA device, ``CPU_COSTS`` otherwise."""
    from orchestrator.budget import H200_COSTS

    return H200_COSTS if device.startswith("cuda") else CPU_COSTS


@dataclass(eq=False)
class Ticket:
    """One live request in the planner. ``options``: its allowed shapes (one = fixed);
    ``shown``: the shape it runs (``str`` for the metric); ``planned_scale``: its estimate's
    level when the current plan was made."""
    options: tuple[Shape, ...]
    estimate: AcceptanceEstimate
    planned_scale: float = math.nan
    shapes: dict = field(default_factory=dict)  # priced shape → the shape the request runs

    @property
    def adaptive(self) -> bool:
        return len(self.options) > 1


class BudgetPlanner:
    """Round shapes for the live requests of one orchestrator (see the module docstring).

    cost: the step cost model; reference: the acceptance reference curve (expected accepted
    drafts per shape) the estimates scale; drift: relative level change that makes a plan
    stale; min_interval: seconds between re-plans for drift or live-set changes (at least);
    max_plan_share: the largest share of wall time re-planning may take; borrow_above:
    with more live requests than this (default 0: always), a request that joins takes the
    shape of a planned one with the same options until the next plan (otherwise it is planned
    at once); clock: seconds."""

    def __init__(self, cost: CostModel, reference=H200_BENCH_ACCEPTED, drift: float = 0.1,
                 min_interval: float = 0.05, borrow_above: int = 0, clock=time.monotonic,
                 max_plan_share: float = 0.01):
        self.cost, self.reference, self.drift, self.min_interval, self.clock = cost, reference, drift, min_interval, clock
        self.max_plan_share, self.interval = max_plan_share, min_interval
        self.borrow_above = borrow_above
        self.live: list[Ticket] = []
        self.plan: dict[Ticket, Shape] = {}
        self.last: StepPlan | None = None  # the current plan (priced shapes, modelled tokens and ms)
        self.stale, self.planned_at, self.plans = True, -math.inf, 0
        self.buckets = [b for b, _ in cost.draft_ms]

    def _priced(self, shape: Shape) -> Shape:
        """The shape as the cost model prices it: a tree past the largest drafter bucket as that bucket."""
        if shape.mode is Mode.TREE and shape.nodes > self.buckets[-1]:
            return tree(self.buckets[-1])
        return shape

    def join(self, mode: Mode, budget: int, adaptive: bool = False, block_size: int | None = None) -> Ticket:
        """Register a live request. mode/budget: its mode and tree budget (the cap when
        ``adaptive``, which applies to tree mode only); block_size: the drafter's block (chain)."""
        if mode is Mode.AUTOREGRESSIVE:
            runs = [ONE_TOKEN]
        elif mode is Mode.CHAIN:
            runs = [chain(block_size or self.cost.block_size)]
        elif adaptive:
            top = [tree(budget)] if budget <= self.buckets[-1] else []  # (past the largest bucket: capped at it)
            runs = [ONE_TOKEN] + [tree(b) for b in self.buckets if b < budget] + top
        else:
            runs = [tree(budget)]
        t = Ticket((), AcceptanceEstimate(self.reference))
        t.shapes = {self._priced(s): s for s in runs}
        t.options = tuple(t.shapes)
        self.live.append(t)
        self.stale = True
        return t

    def leave(self, t: Ticket) -> None:
        if t in self.live:
            self.live.remove(t)
            self.plan.pop(t, None)
            self.stale = True

    def fix(self, t: Ticket, shape: Shape) -> None:
        """From now on ``t`` runs ``shape`` (e.g. one-token rounds once its drafter context is full)."""
        if t.options != (shape,):
            t.shapes, t.options = {shape: shape}, (shape,)
            self.plan.pop(t, None)
            self.stale = True

    def next_shape(self, t: Ticket) -> Shape:
        """The shape of ``t``'s next round (re-planning first when due)."""
        now = self.clock()
        due = self.stale and now - self.planned_at >= self.interval
        if t.adaptive and t not in self.plan and not due:
            peer = self._peer(t) if len(self.live) > self.borrow_above else None
            if peer is None:
                due = True
            else:  # take a like request's shape until the next plan (joins make it stale)
                self.plan[t] = self.plan[peer]
        if due:
            self._replan(now)
        return t.shapes[self.plan[t] if t.adaptive else t.options[0]]

    def _peer(self, t: Ticket) -> Ticket | None:
        """The planned adaptive request with ``t``'s options whose level is nearest ``t``'s."""
        like = [u for u in self.plan if u.options == t.options]
        return min(like, key=lambda u: abs(u.estimate.scale - t.estimate.scale), default=None)

    def observe(self, t: Ticket, shape: Shape, expected_accepted: float | None) -> None:
        """After a round of ``shape``: ``expected_accepted`` = Σ P_target(path to v) over its
        nodes (``SpecStats``' per-round value); None for a round that drafted nothing."""
        counter = _SHAPE_COUNTERS.get(shape)
        if counter is None:  # the labelled child, looked up once per shape (observe runs every round)
            counter = _SHAPE_COUNTERS[shape] = ROUND_SHAPES.labels(str(shape))
        counter.inc()
        e = t.estimate
        if shape.drafts and expected_accepted is not None:
            e.observe(self._priced(shape), expected_accepted)
        else:
            e.idle()
        if t.adaptive and abs(e.scale - t.planned_scale) > self.drift * max(t.planned_scale, 0.1):
            self.stale = True

    def _replan(self, now: float) -> None:
        started, live = time.perf_counter(), self.live
        gains = [t.estimate.gains(t.options) for t in live]
        fixed = [None if t.adaptive else t.options[0] for t in live]
        for g, t in zip(gains, live):  # a fixed shape the reference does not price: no gain assumed
            for s in t.options:
                g.setdefault(s, 0.0)
        if any(f is None for f in fixed):
            self.last = plan_step(gains, self.cost, fixed=fixed)
        else:
            self.last = evaluate(fixed, gains, self.cost)
        self.plan = dict(zip(live, self.last.shapes))
        for t in live:
            t.planned_scale = t.estimate.scale
        self.stale, self.planned_at = False, now
        self.plans += 1
        self.interval = max(self.min_interval, (time.perf_counter() - started) / self.max_plan_share)
        PLAN_RATE.set(self.last.tokens_per_ms)
