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

Requests with the same allowed shapes form a group, and a group takes **one shape** per plan
(``budget.plan_groups``): the batch stays homogeneous (one drafter bucket, one rows pattern
per step; a per-request plan at 64 live had rare tree@64 rounds lift a whole draft batch to the
64 graph bucket, and its 1–3 ms re-plans stalled the event loop for everyone — the H200 c=64
gap, 0.92× the best fixed). Candidates: one-token and every drafter bucket up to the cap, so a
plan can always equal the best fixed budget. Everything per round is O(1): ``next_shape`` is a
lookup of the group's shape, ``observe`` updates the request's ``AcceptanceEstimate`` and its
group's sum of levels (the pooled level), and a re-plan costs O(groups × candidates) whatever
the live count (tens of µs). A plan is redone only when stale — the live count left a band
around the count it was made at, a group's pooled level drifted, ``refresh_rounds`` rounds
passed, or a request of a new kind joined (planned at once; a joining request of a known kind
takes its group's shape) — and then at most every ``min_interval`` s. A new plan replaces the
shapes in force only when better by more than ``margin``.

Online correction (``learn``): the planner times its adaptive requests' rounds (one round =
from one ``next_shape`` to the request's next) per (the groups' shapes, live bucket) and, once
enough rounds are in — at a mean live count near the current one (``near``: rounds measured
while requests were still joining are not scaled to the full count by the model, whose scaling
may be off by more than the shapes differ) — uses their mean instead of the cost model's step
time, each measured ÷ model ratio shrunk toward their precision-weighted mean by its own noise
(``shape_sd``: a short noisy trial does not overturn the model's ranking, a long one does); an
untried assignment is priced by the model times the ratio of the measured ones (interpolated in
verify rows), with an optimism of ``explore`` — at most the model's shape-specific error
(``trust``: a model the measurements confirm is not second-guessed by trials), the larger of the
spread of the measured assignments' log ratios (with one measured, its distance from the model)
and the fit's error (``CostModel.fit_error``: a measured shape the model prices right says nothing
of another shape's error beyond the fit's residuals — with ``--steps on`` the orchestrator's
Python, not the GPU, sets the step at c = 64, where the fitted model prices tree@16 right and
one-token 10 % dear) — so that one within about that share of the measured best is tried once.
Not the model's absolute error once two assignments are measured: an error common to every shape
(the H200 at c = 1 runs its rounds at ~0.6 of the fit's time, every shape alike) is already in the
ratio an untried shape is priced by; taken as optimism, it let every low-acceptance request at
c = 1 try one-token or tree@4 rounds, each trial ended by the request's end before it was
measured (session 25: adaptive 3 % below tree@16 in its own shape). So the prior (the fitted cost
model) picks the first shape, and the measured round times correct it when the serving path's
costs are not the model's (another transport, target or host CPU).

Host-wide drift (``common_mode``, plans/0009 session 10): only the shapes in force are measured, so
the others' figures age. A host that slows down (other tenants, thermal, a busy lease) raises the
incumbent's round times and leaves the others' old figures as they were: compared raw, the
incumbent looks dear, untried shapes look worth a trial (the model's error seems to grow) and a
stale, cheaper-looking figure wins a switch to a shape that is not better (session 9's busy H200
lease: adaptive fell over its repeats while the fixed shapes held, 10–14 % tree@4 rounds at c=64).
So the planner keeps a host index per live bucket: the drift of the shapes in force's measured
mean since they became a measurement (beyond twice its standard error: noise is not drift), and
every measurement is compared at the host index of now — scaled by index now ÷ index when it was
taken — and the model's error (``trust``) is read at a constant host speed. A slowdown of every
shape alike then changes no comparison. One shape slowing alone looks the same to the planner
(only the shapes in force are measured), so a figure taken at a host index more than ``regime``
(log) away is ambiguous: it is priced at the better of its scaled and its raw figure, and if that
wins, the shape is re-measured (its old rounds dropped, the raw figure pricing it until the fresh
rounds are enough) rather than switched to on the old figure. One trial does not always settle it:
a shape that slows alone by less than ``regime`` moves the index and scales the others' figures
with it, and a host that recovers while a re-measurement runs leaves the old incumbent's figure
dear at an index that no longer moves. So (``recheck``) a figure of other shapes than those in
force taken at another host index (beyond ``margin``), unmeasured for ``recheck`` × (the rounds of a
measurement + ``refresh_rounds``), is ambiguous too (re-measured if its raw figure wins), and
the shapes a re-measurement moved the planner away from are due one confirming re-measurement
under the same rule, priced at their ratio from before the drift (``RoundTimes.r0``): the loss
of a wrong call is bounded by that wait, and the trials it adds to about 1 / ``recheck`` of the
rounds while the host keeps drifting. Ambiguous figures stay in the interpolation at their
scaled ratio (an untried shape is not priced by one neighbour alone). A request whose own level is far below its
group's break-even (its drafter rarely hits) takes one-token rounds until its level is back
(a probe round every ``probe_every``). Pure Python, torch-free, on the orchestrator's event loop (``python -m
bench.adaptive_overhead planner`` measures its CPU per round, ``python -m bench.budget_sim`` its
decisions in a simulated loop).

Metrics (prometheus-client, exposed with the orchestrator's families by ``use_metrics``):
``specdec:round_shape_total{shape}`` (rounds by the shape verified: "one-token", "chain@15",
"tree@16", …; a fallback round counts as one-token) and ``specdec:budget_plan_tokens_per_ms``
(the current plan's modelled committed tokens per ms over all live requests).
"""
from __future__ import annotations

import bisect
import json
import math
import time
from dataclasses import dataclass, field, fields

import structlog
from prometheus_client import Counter, Gauge

from orchestrator.budget import (H200_BENCH_ACCEPTED, ONE_TOKEN, AcceptanceEstimate, CostModel, Group,
                                 Shape, StepPlan, chain, group_tokens, plan_groups, reference_accepted, tree)
from protocol.types import Mode

ROUND_SHAPES = Counter("specdec:round_shape", "Rounds by the shape the target verified (one-token, chain@N, tree@N; "
                       "a draft fallback counts as one-token)", ["shape"], registry=None)
PLAN_RATE = Gauge("specdec:budget_plan_tokens_per_ms", "Modelled committed tokens per ms of the current round-shape "
                  "plan over all live requests (orchestrator.budget cost model)", multiprocess_mode="liveall",
                  registry=None)  # (one series per shard of a sharded orchestrator, labelled pid)

log = structlog.get_logger("orchestrator.adaptive")
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


def default_cost_model(device: str, steps: bool = False) -> CostModel:
    """For a target on a CUDA device ``H200_STEPS_COSTS`` when the orchestrator exchanges over
    Steps streams (``--steps on``), else ``H200_COSTS``; ``CPU_COSTS`` otherwise."""
    from orchestrator.budget import H200_COSTS, H200_STEPS_COSTS

    if not device.startswith("cuda"):
        return CPU_COSTS
    return H200_STEPS_COSTS if steps else H200_COSTS


_BUCKETS = [0] + [math.ceil(2 * math.log2(n) - 1e-9) for n in range(1, 4097)]


def live_bucket(n: int) -> int:
    """The half-octave bucket of a live count, the key of the measured round times: 1 → 0,
    2 → 2, 3–4 → 4, 5 → 5, 6–8 → 6, 9–11 → 7, 12–16 → 8, …, 46–64 → 12."""
    return _BUCKETS[n] if n < len(_BUCKETS) else math.ceil(2 * math.log2(n) - 1e-9)


class RoundTimes:
    """Measured rounds of one (adaptive shapes, live bucket): exponentially weighted sums (about
    the last ``1 / (1 − decay)`` rounds) of a round's wall time (s), its square and the live
    count it ran at; ``count`` rounds recorded, the last at planner round ``last``. A round
    longer than 4× the mean (a pause of the consumer or the event loop, not the round) counts as
    4× the mean. Host-speed bookkeeping (``BudgetPlanner``'s common-mode correction): ``h`` the
    planner's host index of its live bucket when these rounds last ran (set at creation and at
    every re-plan while they are the shapes in force), ``base`` their mean ÷ the host index when
    they first became a measurement (None before), ``pending`` the measured ÷ model ratio a
    re-measurement was started at (None: not a re-measurement), which prices the shapes until the
    fresh rounds are enough; ``r0`` the measured ÷ model ratio when ``base`` was last set; ``prev``
    (a re-measurement's) the ``RoundTimes`` of the shapes in force when it started; ``alt`` (set when
    a re-measurement moved the planner away from these shapes) the ratio that prices them at their
    confirming re-measurement (``BudgetPlanner``'s ``recheck``). A round of dt ≤ 0 or not finite (a
    clock stepped back) is not recorded."""
    __slots__ = ("dt", "dt2", "n", "w", "count", "last", "h", "base", "pending", "r0", "prev", "alt")

    def __init__(self, h: float = 1.0, pending: float | None = None, prev: RoundTimes | None = None):
        self.dt = self.dt2 = self.n = self.w = 0.0
        self.count = self.last = 0
        self.h, self.base, self.pending, self.prev = h, None, pending, prev
        self.r0 = self.alt = None

    def add(self, dt: float, n: int, decay: float, at: int) -> None:
        if not 0.0 < dt < math.inf:
            return
        if self.count >= 8 and dt * self.w > 4.0 * self.dt:
            dt = 4.0 * self.dt / self.w
        self.dt = self.dt * decay + dt
        self.dt2 = self.dt2 * decay + dt * dt
        self.n = self.n * decay + n
        self.w = self.w * decay + 1.0
        self.count += 1
        self.last = at

    def spread(self, decay: float) -> float:
        """The relative standard error of the mean round time, counting the rounds of one step
        as one sample (the live requests' rounds share the step: mean live count per sample)
        among the about min(count, (1 + decay) / (1 − decay)) rounds the sums hold."""
        mean = self.dt / self.w
        var = max(self.dt2 / self.w - mean * mean, 0.0)
        samples = min(self.count, (1.0 + decay) / (1.0 - decay)) * self.w / self.n
        return math.sqrt(var / max(samples, 1.0)) / mean if mean > 0 else math.inf


class _Group:
    """Live requests with the same allowed shapes: they run one shape (``shape``; None until an
    adaptive group's first plan). ``scale_sum``: Σ of their acceptance levels (the pooled level
    is scale_sum / count, kept in O(1) per round); ``planned_level``: the pooled level at the
    last plan; ``drop_below``: a request of the group whose own level is below it takes one-token
    rounds (its drafts do not pay for their rows at the plan's rate)."""
    __slots__ = ("options", "adaptive", "count", "scale_sum", "shape", "planned_level", "drop_below")

    def __init__(self, options: tuple[Shape, ...]):
        self.options, self.adaptive = options, len(options) > 1
        self.count, self.scale_sum, self.planned_level, self.drop_below = 0, 0.0, math.nan, -math.inf
        self.shape = None if self.adaptive else options[0]


@dataclass(eq=False)
class Ticket:
    """One live request in the planner. ``options``: its allowed shapes as the cost model prices
    them (one = fixed); ``shapes``: priced shape → the shape the request runs (a tree past the
    largest drafter bucket is priced as that bucket); ``planned``: its current round's priced
    shape; ``start``/``n``/``stat``/``epoch``: when its current round started, the live count
    then, the ``RoundTimes`` it will be recorded in (None: not recorded) and the plan epoch it
    started in."""
    options: tuple[Shape, ...]
    estimate: AcceptanceEstimate
    shapes: dict = field(default_factory=dict)
    group: _Group | None = None
    planned: Shape = ONE_TOKEN
    start: float = 0.0
    n: int = 0
    stat: RoundTimes | None = None
    epoch: int = -1
    skip: int = 0  # one-token rounds left before a dropped request's next probe

    @property
    def adaptive(self) -> bool:
        return len(self.options) > 1


class BudgetPlanner:
    """Round shapes for the live requests of one orchestrator (see the module docstring).

    cost: the step cost model (the prior); reference: the acceptance reference curve (expected
    accepted drafts per shape) the estimates scale. Re-planning: a plan is stale when the live
    count left ``band`` (relative) around the count it was made at, when a group's pooled level
    drifted by more than ``drift`` (relative), after ``refresh_rounds`` rounds, or when a request
    of a new kind joined (planned at once); a stale plan is redone at the next round at least
    ``min_interval`` s after the last one and after the last plan's duration / ``max_plan_share``.
    margin: a new plan replaces the shapes in force only if its rate is higher by more than this
    (relative). learn: correct the model by the measured round times of the adaptive groups
    (``decay``: weight per round of the running means; ``min_rounds`` and ``min_steps`` per live
    request: rounds before a measurement replaces the model; ``forget_rounds``: planner rounds after which an unrefreshed
    measurement is dropped; ``explore``: optimism for an unmeasured plan, so one within about
    this share of the measured best is tried once; ``trust``: at most the larger of the spread of
    the log measured ÷ model ratios at this live bucket (largest − smallest; with one measured, its
    |log ratio|) and the cost model's ``fit_error``, so a confirmed model is not second-guessed
    beyond its fit's residuals; ``near``: a measurement counts only at live counts within near × n + 1 of its mean live count (0.05: at 64 live, rounds
    of a ramp through 46–59 are re-measured; at 0.15 a noisy ramp measurement of tree@16 let a
    tree@4 trial win at c=64 in 1 of 8 seeds of ``bench.budget_sim``'s code/chat mix); ``shape_sd``: the
    assumed spread of the model's shape-specific error, against which each measurement's noise
    shrinks its ratio toward the pooled one). drop_margin: a request whose own level is
    below drop_margin × its break-even level takes one-token rounds (0: never) but drafts one probe
    round every ``probe_every`` (its level does not relax meanwhile: the probes raise it when its
    drafter hits again). defer: ``next_shape`` re-plans only for a group that has no shape yet
    (a request of a new kind); a due re-plan waits for ``maintain``, which the serving loop runs
    off the round's critical path (scheduled once the round's verify is sent: at low concurrency the
    event loop is idle then, while a re-plan inside ``next_shape`` delays that round's draft by its
    0.1–0.2 ms). common_mode: compare measurements at one host speed — each one scaled by the drift of
    the shapes in force since it was taken (the module docstring); ``regime``: a measurement taken
    more than this (|log| of the host index) away is re-measured before it can win (False: the raw
    figures, session 9's planner); ``recheck``: a figure from another host index (beyond ``margin``)
    unmeasured for recheck × (max(min_rounds, min_steps · n) + refresh_rounds) rounds is re-measured
    if its raw figure wins (64: the trials stay below ~1.6 % of the rounds while the host drifts; a
    wrong call lasts at most that long — 2,048 steps at 16 live). settle: after the adaptive
    shapes change, rounds that start within settle × the old shapes' mean round time (measured at
    this live bucket; 0 when unmeasured) are not recorded — the other requests' rounds of the old
    shapes are still running and share their steps (with ``--steps on`` at 64 live, a one-token
    round that waits on a step of 17-row tree verifies takes ~2× its own time: a trial from tree@16
    to one-token measured ~10 % dear, the reverse trial clean). clock: seconds."""

    def __init__(self, cost: CostModel, reference=H200_BENCH_ACCEPTED, drift: float = 0.1,
                 min_interval: float = 0.05, clock=time.monotonic, max_plan_share: float = 0.01,
                 band: float = 0.2, refresh_rounds: int = 256, margin: float = 0.01, learn: bool = True,
                 decay: float = 1 - 1 / 2048, min_rounds: int = 128, min_steps: int = 16,
                 forget_rounds: int = 1 << 20, explore: float = 0.15, drop_margin: float = 0.3,
                 probe_every: int = 16, near: float = 0.05, trust: bool = True, shape_sd: float = 0.05,
                 defer: bool = False, common_mode: bool = True, regime: float = 0.15, recheck: int = 64,
                 settle: float = 2.0):
        self.cost, self.reference, self.drift, self.min_interval, self.clock = cost, reference, drift, min_interval, clock
        self.max_plan_share, self.interval, self.band, self.refresh_rounds = max_plan_share, min_interval, band, refresh_rounds
        self.margin, self.learn, self.decay, self.min_rounds, self.min_steps = margin, learn, decay, min_rounds, min_steps
        self.forget_rounds, self.explore, self.drop_margin, self.probe_every = forget_rounds, explore, drop_margin, probe_every
        self.near, self.trust, self.shape_sd, self.defer = near, trust, shape_sd, defer
        self.common_mode, self.regime, self.recheck, self.settle = common_mode, regime, recheck, settle
        self.host: dict[int, float] = {}  # live bucket → host index (1: the speed of its first measurement)
        self.live: dict[Ticket, None] = {}
        self.groups: dict[tuple[Shape, ...], _Group] = {}
        self.last: StepPlan | None = None  # the current plan (a shape per group, expected tokens and ms of a step)
        self.stale, self.planned_at, self.plans, self.plan_n = True, -math.inf, 0, 0
        self.queued_at = -math.inf  # when a ``maintain`` was scheduled that has not run yet (``claim_maintain``)
        self.rounds, self.refresh_at, self.epoch, self.replan_errors = 0, refresh_rounds, 0, 0
        self.times: dict[int, dict[tuple, RoundTimes]] = {}  # live bucket → adaptive shapes → measured rounds
        self._key: tuple = ()  # the adaptive groups' shapes in force: ((group, shape), …)
        self._stats: dict[int, RoundTimes] = {}  # live bucket → RoundTimes of self._key
        self._settle_at = -math.inf  # rounds of self._key that start before this (clock s) are not recorded
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
        shapes = {self._priced(s): s for s in runs}
        t = Ticket(tuple(shapes), AcceptanceEstimate(self.reference), shapes)
        self._enter(t)
        self.live[t] = None
        self._moved()
        return t

    def _enter(self, t: Ticket) -> None:
        g = self.groups.get(t.options)
        if g is None:
            g = self.groups[t.options] = _Group(t.options)
        t.group = g
        g.count += 1
        g.scale_sum += t.estimate.scale

    def _exit(self, t: Ticket) -> None:
        g = t.group
        g.count -= 1
        g.scale_sum = g.scale_sum - t.estimate.scale if g.count else 0.0
        t.stat = None

    def _moved(self) -> None:
        """The live count changed: the plan is stale once it leaves the band."""
        if abs(len(self.live) - self.plan_n) > self.band * self.plan_n:
            self.stale = True

    def leave(self, t: Ticket) -> None:
        if t in self.live:
            del self.live[t]
            self._exit(t)
            self._moved()

    def fix(self, t: Ticket, shape: Shape) -> None:
        """From now on ``t`` runs ``shape`` (e.g. one-token rounds once its drafter context is full)."""
        if t.options != (shape,):
            self._exit(t)
            t.shapes, t.options = {shape: shape}, (shape,)
            self._enter(t)
            self.stale = True

    def next_shape(self, t: Ticket) -> Shape:
        """The shape of ``t``'s next round: its group's shape (one-token if its own level is below
        the group's drop level). O(1): a re-plan runs only when due (see the class docstring;
        with ``defer``, only for a group without a shape); the round that ends here is recorded in
        its ``RoundTimes``."""
        now, g = self.clock(), t.group
        if t.stat is not None:
            t.stat.add(now - t.start, t.n, self.decay, self.rounds)
        if g.shape is None or (not self.defer and self.due()):
            self._replan(now)
        s = g.shape
        if s.nodes and t.estimate.scale < g.drop_below:  # dropped: one-token rounds, a probe every probe_every
            if t.skip > 0:
                t.skip, s = t.skip - 1, ONE_TOKEN
            else:
                t.skip = self.probe_every
        t.planned, t.stat = s, None
        if g.adaptive and self.learn:
            n = len(self.live)
            # not recorded: a request's first round of a plan, and any round that starts while the others may
            # still run the old shapes (``settle``)
            if t.epoch == self.epoch and s is g.shape and now >= self._settle_at:
                t.stat = self._stats.get(n) or self._stat(n)
            t.epoch, t.start, t.n = self.epoch, now, n
        return t.shapes[s]

    def holds(self, t: Ticket) -> bool:
        """Whether ``t``'s one-token rounds may leave their feature rows with the target (the
        target's ``hold``): its group's plan is one-token rounds, so the rows are needed only after
        a re-plan — not a request dropped from its group's drafting plan (its probe rounds draft)."""
        g = t.group
        return g is not None and g.shape is not None and not g.shape.drafts

    def due(self) -> bool:
        """Whether the plan is stale and a re-plan may run now (see the class docstring)."""
        return self.stale and self.clock() - self.planned_at >= self.interval

    def claim_maintain(self) -> bool:
        """Whether the caller should schedule ``maintain`` now: a re-plan is due and none is scheduled
        yet (then one is, until it runs). Without it, every request whose round passed the due time
        before the callback ran scheduled one more (up to the live count per re-plan at c = 64). A
        scheduled one that has not run after 1 s (a callback lost with its loop) no longer blocks."""
        if not self.due() or self.clock() - self.queued_at < 1.0:
            return False
        self.queued_at = self.clock()
        return True

    def maintain(self) -> None:
        """Re-plan if due (``defer``: the caller runs it when the event loop is otherwise idle, as
        a callback whose exception nobody would see). A re-plan that raises keeps the shapes in
        force, is logged (the 1st, 2nd, 4th, 8th … time) and is retried after ``interval``."""
        self.queued_at = -math.inf
        if self.live and self.due():
            now = self.clock()
            try:
                self._replan(now)
            except Exception:  # noqa: BLE001 — serving goes on with the last plan
                self.replan_errors += 1
                self.planned_at = now
                if self.replan_errors & (self.replan_errors - 1) == 0:
                    log.exception("re-plan failed; keeping the shapes in force", failures=self.replan_errors)

    def _stat(self, n: int) -> RoundTimes:
        b = live_bucket(n)
        table = self.times.setdefault(b, {})
        st = table.get(self._key)
        if st is None:
            st = table[self._key] = RoundTimes(self.host.get(b, 1.0))
        self._stats[n] = st
        return st

    def observe(self, t: Ticket, shape: Shape, expected_accepted: float | None) -> None:
        """After a round of ``shape``: ``expected_accepted`` = Σ P_target(path to v) over its
        nodes (``SpecStats``' per-round value); None for a round that drafted nothing. O(1)."""
        counter = _SHAPE_COUNTERS.get(shape)
        if counter is None:  # the labelled child, looked up once per shape (observe runs every round)
            counter = _SHAPE_COUNTERS[shape] = ROUND_SHAPES.labels(str(shape))
        counter.inc()
        e, g = t.estimate, t.group
        before = e.scale
        if shape.drafts and expected_accepted is not None:
            e.observe(self._priced(shape), expected_accepted)
        elif t.planned.nodes:  # a planned draft fell back: not a round of the plan's shapes
            e.idle()
            t.stat = None
        elif g.shape is None or not g.shape.drafts or not g.adaptive:
            e.idle()  # (a dropped request's level does not relax: its probes decide when it drafts again)
        if g is not None and t in self.live:
            g.scale_sum += e.scale - before
            if g.adaptive:
                level = g.scale_sum / g.count
                if abs(level - g.planned_level) > self.drift * max(g.planned_level, 0.1):
                    self.stale = True
        self.rounds += 1
        if self.rounds >= self.refresh_at:
            self.stale = True

    def _replan(self, now: float) -> None:
        started = time.perf_counter()
        active = [g for g in self.groups.values() if g.count > 0]
        groups = [Group(g.options, g.count, g.scale_sum / g.count) for g in active]
        current = [g.shape for g in active] if all(g.shape is not None for g in active) else None
        n, counts = len(self.live), [g.count for g in active]
        adaptive = [k for k, g in enumerate(active) if g.adaptive]

        def model(shapes, scale: float = 1.0) -> float:
            return self.cost.step_counts(zip(shapes, (c * scale for c in counts)))

        step_ms = estimate = model
        if self.learn and adaptive:
            estimate = self._corrected(active, adaptive, model, n)

            optimism = min(self.explore, max(estimate.spread, self.cost.fit_error)) if self.trust else self.explore

            def step_ms(shapes):  # optimism for an untried plan
                ms = estimate(shapes)
                return ms if estimate.measured(shapes) else ms * (1.0 - optimism)
        plan = plan_groups(groups, self.cost, self.reference, current, self.margin, step_ms)
        plan = StepPlan(plan.shapes, plan.tokens, estimate(plan.shapes))
        for g, s, grp in zip(active, plan.shapes, groups):
            g.shape, g.planned_level, g.drop_below = s, grp.level, -math.inf
        key = tuple((active[k], plan.shapes[k]) for k in adaptive)
        if key != self._key:
            self._log_change(active, adaptive, groups, plan, step_ms, estimate, n)
            b = live_bucket(n)
            table = self.times.get(b, {})
            redo = getattr(estimate, "remeasure", {}).get(tuple(plan.shapes[k] for k in adaptive))
            if redo is not None:  # an ambiguous figure won: measure the shapes afresh, priced at it meanwhile
                table[key] = RoundTimes(self.host.get(b, 1.0), pending=redo, prev=table.get(self._key))
            elif key in table:
                table[key].alt = None  # (measured again from now on: no confirmation due)
            old = table.get(self._key)  # the rounds of the old shapes still running end within about settle × their mean
            self._settle_at = now + (self.settle * old.dt / old.w if old is not None and old.w > 0 else 0.0)
            self._key, self._stats = key, {}
            self.epoch += 1
        if self.drop_margin > 0:
            self._drop_levels(active, groups, plan.shapes, model)
        self.last = plan
        self.stale, self.planned_at, self.plan_n = False, now, n
        self.plans += 1
        self.refresh_at = self.rounds + self.refresh_rounds
        self.interval = max(self.min_interval, (time.perf_counter() - started) / self.max_plan_share)
        PLAN_RATE.set(plan.tokens_per_ms)

    def _log_change(self, active, adaptive, groups, plan, step_ms, estimate, n) -> None:
        """Log a change of the adaptive groups' shapes (event "plan": rare, so it costs nothing per
        round): per adaptive group its shape, pooled acceptance level and, per allowed shape with the others
        as planned, the modelled tokens per ms the choice was made on (the step time with the
        optimism of an untried plan) and whether that step time was measured."""
        measured = getattr(estimate, "measured", None)
        for k in adaptive:
            rates = {}
            for s in active[k].options:
                shapes = list(plan.shapes)
                shapes[k] = s
                ms = step_ms(shapes)
                rates[str(s)] = [round(group_tokens(shapes, groups, self.reference) / ms, 4) if ms > 0 else None,
                                 bool(measured and measured(shapes))]
            log.info("plan", live=n, shape=str(plan.shapes[k]), requests=active[k].count,
                     accept_level=round(groups[k].level, 3), tokens_per_ms=rates, plans=self.plans)

    def _corrected(self, active, adaptive, model, n):
        """The step time of an assignment at n live: measured (its rounds' mean wall time at this
        live bucket, scaled by the model from the measured mean live count to n) where the same
        adaptive groups ran those shapes for ``min_rounds`` rounds and ``min_steps`` rounds per
        live request lately at a mean live count within ``near`` · n + 1 of n — its measured ÷
        model ratio shrunk toward the precision-weighted mean of those ratios by its relative
        standard error against ``shape_sd``; otherwise the model times the ratio of the measured
        assignments at this bucket, interpolated in log verify rows between the nearest ones (a
        model error grows or shrinks with the tree, so a tree@64 is not priced by a tree@4's
        error). With ``common_mode`` every measured ratio is first brought to the host speed of now
        (``_host_drift``); one taken more than ``regime`` away, or due a re-check (``recheck``), is
        priced at the better of its raw and scaled figure (and its ``alt``, if set), kept in the pooled
        and interpolated ratios at its scaled figure, and listed in ``.remeasure`` (adaptive shapes →
        that ratio) for ``_replan``; a re-measurement still short of rounds is priced at the ratio it
        started at, and one done while in force marks the shapes it left (``prev``) for confirmation.
        ``.measured(shapes)``: whether an assignment's time is measured; ``.spread``: how far the
        model's error differs between the measured assignments — the largest minus the smallest log
        ratio; with one, its |log ratio| at the host index's reference speed (all there is to go
        by); inf when nothing is measured."""
        found = []  # [times key, RoundTimes, adaptive shapes, log rows, model ms at n, measured ÷ model, its relative standard error]
        groups, enough = tuple(active[k] for k in adaptive), max(self.min_rounds, self.min_steps * n)
        counts = [g.count for g in active]
        b = live_bucket(n)
        table, fixed, remeasure = self.times.get(b, {}), {}, {}

        def log_rows(shapes) -> float:
            return math.log(sum(c * s.rows for c, s in zip(counts, shapes)))

        for key, st in table.items():
            if tuple(g for g, _ in key) != groups:
                continue
            shapes = [g.shape for g in active]
            for k, (_, s) in zip(adaptive, key):
                shapes[k] = s
            if st.count < enough or self.rounds - st.last > self.forget_rounds or abs(st.n / st.w - n) > self.near * n + 1.0:
                if st.pending is not None and st.count < enough:  # a re-measurement under way
                    fixed[tuple(s for _, s in key)] = model(shapes) * st.pending
                continue
            at_n = model(shapes)
            ms = 1000.0 * st.dt / st.w * at_n / model(shapes, st.n / st.w / n)
            found.append([key, st, tuple(s for _, s in key), log_rows(shapes), at_n, ms / at_n, st.spread(self.decay)])
            if st.pending is not None:  # a re-measurement done: if it moved the planner, confirm the shapes it left
                if key == self._key and st.prev is not None:
                    st.prev.alt = st.prev.r0
                st.pending = st.prev = None
        host = self._host_drift(b, table, found) if self.common_mode else 1.0
        if self.common_mode:
            due = self.rounds - self.recheck * (enough + self.refresh_rounds)
            for f in found:
                st, scale = f[1], host / f[1].h
                drift = abs(math.log(scale))
                stale = f[0] != self._key and st.last < due and (drift > self.margin or st.alt is not None)
                if drift > self.regime or stale:  # another host regime, or long unchecked: raw or scaled? re-measure to know
                    r = min(f[5], f[5] * scale, st.alt or math.inf)
                    fixed[f[2]], remeasure[f[2]] = f[4] * r, r
                f[5] *= scale  # (interpolated and pooled at the host of now, as if the drift were the host's)
        # shrink each ratio toward the precision-weighted mean ratio by its noise (empirical Bayes,
        # shape-specific deviations ~ N(0, shape_sd²)): a noisy measurement leaves the model's ranking
        weights = [1.0 / max(f[6], 1e-6) ** 2 for f in found]
        pooled = sum(w * f[5] for w, f in zip(weights, found)) / sum(weights) if found else 1.0
        sd2 = self.shape_sd ** 2
        measured, known = {}, []
        for _, _, shapes_key, x, at_n, r, e in found:
            r = pooled + (r - pooled) * sd2 / (sd2 + e * e)
            measured[shapes_key] = at_n * r
            known.append((x, r))
        known.sort()
        measured.update(fixed)

        def ratio(x: float) -> float:
            if not known:
                return 1.0
            k = bisect.bisect_left(known, (x,))
            if k == 0:
                return known[0][1]
            if k == len(known):
                return known[-1][1]
            (x0, r0), (x1, r1) = known[k - 1], known[k]
            return r0 + (r1 - r0) * (x - x0) / (x1 - x0) if x1 > x0 else r1

        def step_ms(shapes) -> float:
            ms = measured.get(tuple(shapes[k] for k in adaptive))
            return ms if ms is not None else ratio(log_rows(shapes)) * model(shapes)
        step_ms.measured = lambda shapes: tuple(shapes[k] for k in adaptive) in measured
        logs = [math.log(r) for _, r in known]
        # (one measured: how far its ratio is from 1 is the only hint of how wrong the model may be elsewhere)
        step_ms.spread = (max(logs) - min(logs) if len(logs) > 1 else abs(logs[0] - math.log(host))) if logs else math.inf
        step_ms.remeasure = remeasure
        return step_ms

    def _host_drift(self, b: int, table, found) -> float:
        """The host index of live bucket ``b`` (1: the host's speed at the bucket's first
        measurement), updated from the shapes in force: their measured ÷ model ratio over their
        ratio when they first became a measurement (``RoundTimes.base``, in units of the index
        then) is the host's drift since; only its part beyond twice the measurement's relative
        standard error moves the index (noise and a better estimate of the shapes' own cost are not
        drift). Marks the shapes in force as measured at the returned index (``RoundTimes.h``).
        O(1): runs at a re-plan. Why: only the shapes in force are measured, so a slowdown of the
        whole host shows as a slowdown of them alone; read at one host speed, the comparison with
        the others' older figures is the one a steady host would give."""
        host = self.host.get(b, 1.0)
        for key, st, _, _, _, r, e in found:
            if key == self._key and 0.0 < r < math.inf:
                if st.base is None or st.count * (1.0 - self.decay) < 1.0:
                    st.base, st.r0 = r / host, r  # (until the running mean's window is full: rounds at the ramp's
                    # lower live counts, scaled by the model, still leave it; that is not drift)
                else:
                    d, band = math.log(r / (st.base * host)), 2.0 * e
                    if abs(d) > band:
                        host *= math.exp(d - math.copysign(band, d))
                        self.host[b] = host
        cur = table.get(self._key)
        if cur is not None:
            cur.h = host
        return host

    def _drop_levels(self, active, groups, shapes, model) -> None:
        """Per drafting adaptive group: the level below which one of its requests is better off
        in one-token rounds — its expected accepted drafts (level · reference) below the plan's
        tokens per ms × the model's ms it adds by drafting — times ``drop_margin``."""
        counts = [g.count for g in active]
        ms = model(shapes)
        rate = group_tokens(shapes, groups, self.reference) / ms if ms > 0 else 0.0
        for k, g in enumerate(active):
            s, ref = shapes[k], reference_accepted(self.reference, shapes[k])
            if not g.adaptive or not s.drafts or not ref:
                continue
            less = counts[:k] + [counts[k] - 1] + counts[k + 1:]
            saved = ms - self.cost.step_counts(list(zip(shapes, less)) + [(ONE_TOKEN, 1)])
            g.drop_below = self.drop_margin * rate * saved / ref
