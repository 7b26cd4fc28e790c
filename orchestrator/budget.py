"""Adaptive tree budget (issue 14, plans/0009): per step, the round shape of every request in
the batch — a one-token round, the drafter's chain, or a DDTree tree of one of the drafter's
graph budgets — chosen to maximise the step's expected committed tokens per second.

Pure Python (torch-free, numpy-free): ``orchestrator.adaptive.BudgetPlanner`` calls
``plan_step`` when the live set or the estimates change and gives each request its round's
shape (the serving path).

The model (its assumptions, each to be checked by ``bench/concurrency.py``):
- **Tokens.** A round of shape s commits 1 + g_i(s) tokens in expectation, g_i(s) = expected
  accepted drafts = Σ over the tree's nodes of P_target(path to node) (DOMAIN §4; with
  sample-and-match this is exactly the expected accept length minus the bonus). A request's
  curve g_i is the reference curve G measured on a prompt set, scaled by the request's own
  recent level (``AcceptanceEstimate``): the request's trees are assumed to have the shape of
  the reference ones, only more or less often right. g_i(s) never exceeds s's node count.
- **Time.** One step = one round of every request: one batched draft call (skipped when no
  request drafts) + one batched verify forward over all rows of all requests + per-request
  serial host work + fixed per-step latency:
  ``T = step_ms + [anyone drafts]·(spec_step_ms + draft(max drafter bucket in the step,
  drafting requests)) + verify(Σ rows) + Σ (host_ms + spec_host_ms·[drafts] + host_ms_per_row · rows)``.
  Through the services (``H200_COSTS``) the Σ term is the orchestrator's serial Python work per
  round (one process serves every request, so it adds up over the batch) and step_ms /
  spec_step_ms the wire latency of a round / of its draft exchange (paid once per step: the
  requests' rounds overlap on the wire). Verify time depends only on the step's total rows
  (attention over each request's own context is folded into the measured table, taken at one
  context length); the batched drafter runs its largest bucket for everyone (a smaller
  budget is a truncation of the bucket's best-first tree), costing its batch-1 figure plus
  ``draft_ms_per_request`` per further drafting request.
- **Objective.** Maximise Σ_i (1 + g_i(s_i)) / T over the batch: throughput of the step, not
  any one request's latency (a request's own budget cap and mode restrict its shapes).

Shapes: ``Shape(Mode.AUTOREGRESSIVE, 0)`` (one row, no drafter call), ``Shape(Mode.CHAIN,
block_size − 1)`` (the drafter's block as a chain), ``Shape(Mode.TREE, b)`` (b non-root nodes).
"""
from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from modeling import acceptance
from protocol.types import Mode


_MODE_CODE = {Mode.AUTOREGRESSIVE: 0, Mode.CHAIN: 1, Mode.TREE: 2}


@dataclass(frozen=True, order=True)
class Shape:
    """One request's round in a step: ``nodes`` = non-root draft nodes (the tree budget;
    0 for a one-token round), verified as ``nodes + 1`` rows (root = the pending bonus)."""
    mode: Mode
    nodes: int

    def __post_init__(self):  # hashed at every planner dict lookup, every round: once, here (ints only:
        # the same value in every process, so a pickled shape keeps a valid hash)
        object.__setattr__(self, "_hash", hash((_MODE_CODE[self.mode], self.nodes)))
        object.__setattr__(self, "drafts", self.mode is not Mode.AUTOREGRESSIVE)  # (read every round: an attribute)

    def __hash__(self) -> int:
        return self._hash

    @property
    def rows(self) -> int:
        return self.nodes + 1

    def __str__(self) -> str:
        return {Mode.AUTOREGRESSIVE: "one-token", Mode.CHAIN: f"chain@{self.nodes}"}.get(self.mode, f"tree@{self.nodes}")


ONE_TOKEN = Shape(Mode.AUTOREGRESSIVE, 0)


@functools.cache
def chain(block_size: int) -> Shape:
    """The drafter's block as a chain (one instance per size: dict lookups of it hit by identity)."""
    return Shape(Mode.CHAIN, block_size - 1)


@functools.cache
def tree(budget: int) -> Shape:
    """A tree of ``budget`` nodes (one instance per budget)."""
    return Shape(Mode.TREE, budget)


def _interp(points: Sequence[tuple[int, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (ascending x), extended by the end segments' slopes
    (never below the first point's value on the left)."""
    xs = [p[0] for p in points]
    if len(points) == 1:
        return points[0][1]
    if x <= xs[0]:
        return points[0][1]
    k = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[k - 1], points[k]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class CostModel:
    """Measured per-step costs (ms) on one device.

    verify_ms: (total rows in the step's verify forward, ms) ascending; made non-decreasing at
    construction (a later point below an earlier one is timing noise); past the last point it
    grows by the last segment's slope. chain_draft_ms: one drafting request's chain draft call;
    draft_ms: (drafter graph bucket = tree budget, ms at one drafting request) ascending — a
    budget b uses the smallest bucket >= b, and is allowed only up to the largest.
    draft_ms_per_request: extra ms per further drafting request in the batched draft call.
    host_ms / host_ms_per_row: per-request serial host work per step (acceptance walk,
    detokenisation, stop checks, message handling); spec_host_ms: extra serial host work per
    drafting request (the draft exchange's messages, tree structure); spec_step_ms: extra
    latency per step in which anything drafts (the draft exchange); step_ms: fixed latency per
    step (the verify exchange beyond the forward). fit_error: the rms |log predicted ÷ measured|
    tok/s of the cells the fitted terms came from (0: unknown) — how far an unmeasured shape's
    true cost may sit from the model's, which a measurement of another shape cannot narrow.
    """
    verify_ms: tuple[tuple[int, float], ...]
    chain_draft_ms: float
    draft_ms: tuple[tuple[int, float], ...]
    draft_ms_per_request: float = 0.0
    host_ms: float = 0.0
    host_ms_per_row: float = 0.0
    spec_host_ms: float = 0.0
    spec_step_ms: float = 0.0
    step_ms: float = 0.0
    block_size: int = 16
    fit_error: float = 0.0

    def __post_init__(self):
        if not self.verify_ms or not self.draft_ms:
            raise ValueError("verify_ms and draft_ms need at least one point each")
        pts, top = [], float("-inf")
        for rows, ms in sorted(self.verify_ms):
            top = max(top, ms)
            pts.append((rows, top))
        object.__setattr__(self, "verify_ms", tuple(pts))
        object.__setattr__(self, "draft_ms", tuple(sorted(self.draft_ms)))

    def verify(self, rows: int) -> float:
        """ms of one verify forward over ``rows`` rows (0 rows: no forward)."""
        return _interp(self.verify_ms, rows) if rows > 0 else 0.0

    def draft_call(self, shape: Shape) -> float:
        """ms of ``shape``'s draft call alone (0 for a one-token round)."""
        if not shape.drafts:
            return 0.0
        if shape.mode is Mode.CHAIN:
            return self.chain_draft_ms
        buckets = [b for b, _ in self.draft_ms]
        k = bisect.bisect_left(buckets, shape.nodes)
        if k == len(buckets):
            raise ValueError(f"tree budget {shape.nodes} exceeds the largest drafter bucket {buckets[-1]}")
        return self.draft_ms[k][1]

    def host(self, shape: Shape) -> float:
        return self.host_ms + self.host_ms_per_row * shape.rows + self.spec_host_ms * shape.drafts

    def step_counts(self, counts) -> float:
        """ms of one step in which ``count`` requests take ``shape``, for each (shape, count) of
        ``counts`` (counts may be fractional): ``step`` over an aggregated batch, O(len(counts))
        whatever the number of requests."""
        rows = host = drafting = draft = 0.0
        for s, n in counts:
            if n <= 0:
                continue
            rows += n * s.rows
            host += n * self.host(s)
            if s.drafts:
                drafting += n
                draft = max(draft, self.draft_call(s))
        if drafting:
            draft += self.draft_ms_per_request * max(drafting - 1, 0.0) + self.spec_step_ms
        return self.step_ms + draft + self.verify(rows) + host

    def shapes(self) -> list[Shape]:
        """Every shape this cost model prices: one-token, chain, a tree per drafter bucket."""
        return [ONE_TOKEN, chain(self.block_size)] + [tree(b) for b, _ in self.draft_ms]

    def step(self, shapes: Sequence[Shape]) -> float:
        """ms of one step in which request i takes ``shapes[i]``."""
        drafting = [s for s in shapes if s.drafts]
        draft = 0.0
        if drafting:
            draft = (max(self.draft_call(s) for s in drafting) + self.draft_ms_per_request * (len(drafting) - 1)
                     + self.spec_step_ms)
        return (self.step_ms + draft + self.verify(sum(s.rows for s in shapes))
                + sum(self.host(s) for s in shapes))


def shared_by(cost: CostModel, processes: int) -> CostModel:
    """The step as one of ``processes`` equal orchestrator processes sharing the workers sees it
    (``python -m orchestrator --processes N``, ``serving.shards``): its requests are about 1/N of
    the workers' batch, so the GPU terms price N × its rows and drafting requests — verify at N ×
    the rows (the table's row axis divided by N), every draft call N − 1 more requests'
    ``draft_ms_per_request`` and each of its drafting requests N of them — while the serial host
    terms (host_ms, spec_host_ms, host_ms_per_row: one process's Python) and the per-step latencies
    stay this process's. For tables whose host terms are the orchestrator's own work (the GPU
    tables; the CPU tables put the workers' per-request forward into ``host_ms``). Assumes the
    shards hold equal shares (the kernel spreads connections evenly at high concurrency; one
    client connection carrying every stream puts them all on one shard, which then plans for N
    times its load). A step with fewer than one drafting request (a fractional count, as the
    planner's scaled measurements make) pays N − 1 others' draft cost, not N·d − 1.
    processes = 1: ``cost`` itself; ValueError below 1."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if processes == 1:
        return cost
    extra = cost.draft_ms_per_request * (processes - 1)
    return replace(cost, verify_ms=tuple((rows / processes, ms) for rows, ms in cost.verify_ms),
                   chain_draft_ms=cost.chain_draft_ms + extra,
                   draft_ms=tuple((b, ms + extra) for b, ms in cost.draft_ms),
                   draft_ms_per_request=cost.draft_ms_per_request * processes)


# H200, bf16, SmolLM2 target + the step-10,909 drafter (block 8), through the real services
# with batched workers (bench/results/concurrency_h200.json as of 53866cc, 01:01 UTC on 2026-12-01; later runs
# replaced that file — ``git show 53866cc:bench/results/concurrency_h200.json``):
# ``python -m bench.cost_table --fit-concurrency <that file>`` →
# bench/results/cost_model_h200.json / .md (the same figures; a test checks they agree).
# GPU parts measured in-process: verify_ms = the one-request verify forward, "graphs"
# (bench/results/gpu_fast_path_h200.json, 22:38 UTC on 2026-11-30); draft_ms = the batched
# drafter at batch 1 (bench/results/draft_batch_costs_h200.md, 00:31 UTC; tree@256/512 from the
# fast-path table), draft_ms_per_request = the mean of its per-request fits over the trees.
# Fitted to the 20 fixed cells (AR, chain@7, tree@4/16/64 × c = 1/4/16/64; least squares of
# the relative step-time error, terms >= 0): step_ms 0.98 and spec_step_ms 1.83 (wire latency
# of a round and of its draft exchange, beyond the GPU), host_ms 0.29 + spec_host_ms 0.16 +
# host_ms_per_row 0.0026 per request (serial: the one orchestrator process). Cells within
# -10…+15 % (c=1 low, c=4 high: batches hardly form at c=4, 1.1 per verify); the plan for
# uniform requests is the measured best fixed shape at c = 1, 16, 64 and tree@16 at c=4
# (3.1 % below the measured tree@64, which the model prices within 1 %).
H200_COSTS = CostModel(
    verify_ms=((1, 1.078), (2, 1.084), (5, 1.09), (17, 1.102), (33, 1.117), (65, 1.174), (129, 1.258),
               (257, 1.56), (513, 2.396)),
    chain_draft_ms=0.281,
    draft_ms=((4, 0.278), (16, 0.29), (64, 0.335), (256, 0.542), (512, 0.75)),
    draft_ms_per_request=0.0289,
    host_ms=0.2916,
    host_ms_per_row=0.0026,
    spec_host_ms=0.1574,
    spec_step_ms=1.8325,
    step_ms=0.983,
    block_size=8,  # the shipped drafter's block (the chain figures are chain@7)
    fit_error=0.084,  # rms |log predicted ÷ measured| over the 20 cells (cost_model_h200.json)
)

# The same GPU tables with the terms fitted to the runs with ``--steps on`` (one orchestrator process): sessions 22
# and 23, three leases, 52 cells pooled (every fixed shape at c = 1, 4, 16, 64 once; autoregressive and tree@16 at
# each c in three more repeats, tree@64 in two): ``python -m bench.cost_table --fit-concurrency
# bench/results/concurrency_h200_s22_steps_fit.json,bench/results/concurrency_h200_s22_steps_on.json,
# bench/results/concurrency_h200_s23_steps_on.json --out bench/results/cost_model_h200_steps.json`` (.md next to it).
# Without the workers' per-request messages the wire latency of a step and the orchestrator's serial host work are
# smaller, and a one-token round's host work is ~0.6 of a drafting round's (host_ms 0.115 vs + spec_host_ms 0.192):
# the plan for uniform requests is the measured best fixed shape at every c — tree@64 at c = 1, tree@16 at c = 4
# and 16, one-token at c = 64 (7466 vs tree@16 6708 tok/s, the means). Cells within -19…+44 % (autoregressive at
# c = 4 the worst: the self-clocked sender holds a round that arrives while a step is in flight; single runs of one
# cell differ by up to 19 % between leases), fit error 0.151.
H200_STEPS_COSTS = replace(H200_COSTS, step_ms=0.7757, spec_step_ms=0.892, host_ms=0.1146, spec_host_ms=0.1922,
                           host_ms_per_row=0.0022, fit_error=0.151)

# Reference curve G: expected accepted drafts per round (τ − 1) per shape, greedy, bench
# prompts, the same run at c=1 (chain@7 τ 2.393, tree@4 2.523, tree@16 3.065, tree@64 3.449);
# tree@256/512: tree@64's figure × their ratio to tree@64 in the fast-path run of the
# session-4 drafter (τ 3.301 / 3.71 / 3.819), not measured with this drafter.
H200_BENCH_ACCEPTED = {chain(8): 1.393, tree(4): 1.523, tree(16): 2.065, tree(64): 2.449,
                       tree(256): 2.884, tree(512): 3.0}


def reference_accepted(reference: Mapping[Shape, float], shape: Shape) -> float | None:
    """The reference curve's expected accepted drafts for ``shape``: its own value, else
    interpolated linearly in node count between the same mode's values (0 nodes: 0); None for
    a one-token round or past the largest reference of its mode."""
    if not shape.drafts:
        return None
    if shape in reference:
        return reference[shape]
    known = sorted((s.nodes, v) for s, v in reference.items() if s.mode is shape.mode)
    if not known or shape.nodes > known[-1][0]:
        return None
    return _interp([(0, 0.0)] + known, shape.nodes)


class AcceptanceEstimate:
    """A request's recent acceptance as one level ``scale`` against a reference curve:
    g(s) = min(scale · reference[s], s.nodes) expected accepted drafts for shape s.

    ``observe`` folds in one verified round (an exponential moving average of
    observed / reference with weight ``weight``; the observed value is Σ P_target(path to v) over
    the round's nodes, the same quantity as ``SpecStats.expected_accepted``). ``idle`` is called
    for a one-token round, which says nothing about the drafter: the level relaxes toward
    ``prior`` by ``relax``, so a request pushed to one-token rounds (a drafter that stopped
    hitting, or a large batch) is probed again later instead of never.

    One round's accepted count is noisy (greedy: 0 … nodes, spread about as wide as its mean),
    so a short average wanders: at weight 0.2 a request at 0.75 of the reference dipped under
    the H200 model's one-token threshold (~0.65 at c=64) for a third of its rounds in
    ``python -m bench.budget_sim``; at 0.05 (about the last 20 rounds) for ~3 %.
    """

    def __init__(self, reference: Mapping[Shape, float], prior: float = 1.0, weight: float = 0.05,
                 relax: float = 0.02, max_scale: float = 4.0):
        if any(v <= 0 for v in reference.values()):
            raise ValueError("reference accepted drafts must be > 0 for every shape")
        self.reference, self.prior, self.weight, self.relax, self.max_scale = reference, prior, weight, relax, max_scale
        self.scale = prior

    def observe(self, shape: Shape, expected_accepted: float) -> None:
        """One round of ``shape`` whose nodes' path probabilities sum to ``expected_accepted``.
        A shape without a reference value (a budget between buckets) uses the reference curve
        interpolated linearly in node count (0 nodes: 0); past the largest, it counts as idle."""
        ref = self._reference(shape)
        if ref is None:
            return self.idle()
        ratio = min(max(expected_accepted / ref, 0.0), self.max_scale)
        self.scale += self.weight * (ratio - self.scale)

    def observe_round(self, shape: Shape, edge_probs: list[float], parents: list[int]) -> None:
        """As ``observe``, from the edge probabilities a Verify returned for the round's tree."""
        self.observe(shape, acceptance.expected_accepted(edge_probs, parents))

    def idle(self) -> None:
        self.scale += self.relax * (self.prior - self.scale)

    def _reference(self, shape: Shape) -> float | None:
        return reference_accepted(self.reference, shape)

    def gains(self, shapes: Sequence[Shape]) -> dict[Shape, float]:
        """Expected accepted drafts per allowed shape (the one-token round: 0), for ``plan_step``."""
        out = {}
        for s in shapes:
            ref = self._reference(s) if s.drafts else 0.0
            if ref is not None:
                out[s] = min(self.scale * ref, float(s.nodes))
        return out


@dataclass(frozen=True)
class StepPlan:
    """``shapes[i]`` for request i (``plan_step``) or group i (``plan_groups``); ``tokens``:
    expected committed tokens of the step; ``ms``: its modelled (or, from the planner, measured)
    time; ``tokens_per_ms`` = tokens / ms (0 for an empty batch)."""
    shapes: tuple[Shape, ...]
    tokens: float
    ms: float

    @property
    def tokens_per_ms(self) -> float:
        return self.tokens / self.ms if self.ms > 0 else 0.0


EXACT_LIMIT = 64  # joint assignments searched exhaustively (7 shapes: up to 2 requests; 343 cost ~7 ms)


def evaluate(shapes: Sequence[Shape], gains: Sequence[Mapping[Shape, float]], cost: CostModel) -> StepPlan:
    """The modelled step for a given assignment (raises KeyError for a shape a request lacks)."""
    tokens = sum(1.0 + (g[s] if s.drafts else 0.0) for s, g in zip(shapes, gains))
    return StepPlan(tuple(shapes), tokens, cost.step(shapes))


def plan_step(gains: Sequence[Mapping[Shape, float]], cost: CostModel, exact_limit: int = EXACT_LIMIT,
              fixed: Sequence[Shape | None] | None = None) -> StepPlan:
    """Choose each request's round shape for one step.

    gains[i]: request i's allowed shapes → expected accepted drafts per round (a one-token
    round is always allowed, gain 0; leave out shapes the request's mode, budget cap or
    drafter context forbid). fixed[i]: a shape the policy does not choose for request i (an
    autoregressive or chain request, a fixed tree budget; gains[i] must price it unless it is
    one-token); such a request still counts in the step's time and tokens. Returns the plan with the highest modelled tokens per ms found:
    the exact optimum when the joint choices number <= ``exact_limit``; otherwise the best of
    all-one-token, every "top-k" plan (the k requests that accept most at one shape take it, the
    rest one-token; k = all is the uniform plan) and a Dinkelbach iteration per drafter-cost level (per request: argmax of
    g − λ·(marginal verify ms per row · rows + host ms + draft ms per request), λ = the current
    plan's tokens per ms, requests updated one at a time with the verify table's exact
    difference), then polished by single-request moves on the exact rate — so it is never below
    any fixed budget under the model.
    Cost: O(levels · iterations · requests · shapes) Python steps (a few ms at 64 requests).
    """
    if not gains:
        return StepPlan((), 0.0, 0.0)
    fixed = fixed or [None] * len(gains)
    options = [[f] if f is not None else [ONE_TOKEN] + sorted(s for s in g if s.drafts) for g, f in zip(gains, fixed)]
    gains = [{**g, ONE_TOKEN: 0.0} for g in gains]
    n_joint = 1
    for o in options:
        n_joint *= len(o)
    if n_joint <= exact_limit:
        return max((evaluate(a, gains, cost) for a in itertools.product(*options)), key=lambda p: p.tokens_per_ms)

    universe = sorted({s for o in options for s in o})
    dcall = {s: cost.draft_call(s) for s in universe}
    host = {s: cost.host(s) for s in universe}

    def rate(assign: list[Shape]) -> float:  # cost.step and evaluate, inlined over the cached figures
        tokens = rows = hms = draft = 0.0
        drafting = 0
        for s, g in zip(assign, gains):
            tokens += 1.0 + g[s]
            rows += s.rows
            hms += host[s]
            if s.nodes:
                drafting += 1
                draft = max(draft, dcall[s])
        if drafting:
            draft += cost.draft_ms_per_request * (drafting - 1) + cost.spec_step_ms
        return tokens / (cost.step_ms + draft + cost.verify(rows) + hms)

    base = [o[0] for o in options]  # all one-token (fixed requests: their shape)
    best, best_rate = base, rate(base)
    tokens0, rows0, hms0 = sum(1.0 + g[s] for s, g in zip(base, gains)), sum(s.rows for s in base), sum(map(host.get, base))
    drafting0, dmax0 = sum(1 for s in base if s.nodes), max((dcall[s] for s in base if s.nodes), default=0.0)
    for shape in universe:  # the k most accepting requests at one shape, the rest one-token (k = all: uniform)
        if not shape.nodes:
            continue
        order = sorted((i for i, (g, f) in enumerate(zip(gains, fixed)) if f is None and shape in g),
                       key=lambda i: -gains[i][shape])
        tokens, rows, hms, drafting, k_best = tokens0, rows0, hms0, drafting0, 0
        for k, i in enumerate(order, 1):
            tokens, rows, hms, drafting = tokens + gains[i][shape], rows + shape.rows - 1, hms + host[shape] - host[ONE_TOKEN], drafting + 1
            draft = max(dmax0, dcall[shape]) + cost.draft_ms_per_request * (drafting - 1) + cost.spec_step_ms
            if (r := tokens / (cost.step_ms + draft + cost.verify(rows) + hms)) > best_rate:
                best_rate, k_best = r, k
        if k_best:
            best = list(base)
            for i in order[:k_best]:
                best[i] = shape
    for level in sorted({dcall[s] for s in universe if s.drafts}):
        allowed = [[(s, g[s], s.rows, host[s] + cost.draft_ms_per_request * s.drafts) for s in o
                    if dcall[s] <= level or len(o) == 1] for o, g in zip(options, gains)]
        assign, lam = best, best_rate
        for _ in range(8):
            # one request at a time against the others' current shapes (Gauss-Seidel): its verify
            # ms are the table's exact difference at the step's rows, not a slope taken before
            # anyone moved — moving every request on one slope overshoots where verify cost bends
            # (flat below a bucket, steep above) and oscillates between two plans
            nxt, rows = list(assign), sum(s.rows for s in assign)
            for i, o in enumerate(allowed):
                others = rows - nxt[i].rows
                pick = max(o, key=lambda t: t[1] - lam * (cost.verify(others + t[2]) + t[3]))
                nxt[i], rows = pick[0], others + pick[2]
            if nxt == assign:
                break
            assign, lam = nxt, rate(nxt)
            if lam > best_rate:
                best, best_rate = assign, lam
    return evaluate(_polish(best, options, gains, cost, dcall, host), gains, cost)


def _polish(assign: list[Shape], options, gains, cost: CostModel, dcall, host, passes: int = 4) -> list[Shape]:
    """Single-request moves on the exact modelled rate until none improves it (at most
    ``passes`` sweeps): the Dinkelbach plan is optimal for a linearised verify cost, and one
    request's better shape can still hide behind a bend of the table. O(passes · requests ·
    shapes²) with the step's totals kept incrementally."""
    assign = list(assign)
    count: dict[Shape, int] = {}
    for s in assign:
        count[s] = count.get(s, 0) + 1
    tokens = sum(1.0 + g[s] for s, g in zip(assign, gains))
    rows, hms = sum(s.rows for s in assign), sum(host[s] for s in assign)

    def rate(tokens, rows, hms) -> float:
        drafting = sum(c for s, c in count.items() if s.nodes)
        draft = max((dcall[s] for s, c in count.items() if c and s.nodes), default=0.0)
        if drafting:
            draft += cost.draft_ms_per_request * (drafting - 1) + cost.spec_step_ms
        return tokens / (cost.step_ms + draft + cost.verify(rows) + hms)

    now = rate(tokens, rows, hms)
    for _ in range(passes):
        moved = False
        for i, o in enumerate(options):
            for t in o:
                s, g = assign[i], gains[i]
                if t == s:
                    continue
                count[s] -= 1
                count[t] = count.get(t, 0) + 1
                moved_to = (tokens - g[s] + g[t], rows - s.rows + t.rows, hms - host[s] + host[t])
                if (r := rate(*moved_to)) > now * (1 + 1e-12):
                    assign[i], (tokens, rows, hms), now, moved = t, moved_to, r, True
                else:
                    count[t] -= 1
                    count[s] += 1
        if not moved:
            break
    return assign


# ---- one shape per group (the serving path: orchestrator.adaptive.BudgetPlanner)

@dataclass(frozen=True)
class Group:
    """``count`` live requests that take one shape per step: ``options`` the shapes the policy
    may give them (one shape: fixed — autoregressive, chain, a fixed tree budget), ``level``
    their mean acceptance level (``AcceptanceEstimate.scale``: g(s) = level · reference[s],
    at most s's nodes)."""
    options: tuple[Shape, ...]
    count: float
    level: float = 1.0


def group_tokens(shapes: Sequence[Shape], groups: Sequence[Group], reference: Mapping[Shape, float]) -> float:
    """Expected committed tokens of one step: Σ count · (1 + min(level · reference[s], nodes));
    a shape the reference does not price gains nothing."""
    total = 0.0
    for s, g in zip(shapes, groups):
        ref = reference_accepted(reference, s) if s.drafts else None
        total += g.count * (1.0 + (min(g.level * ref, float(s.nodes)) if ref is not None else 0.0))
    return total


def plan_groups(groups: Sequence[Group], cost: CostModel, reference: Mapping[Shape, float] = H200_BENCH_ACCEPTED,
                current: Sequence[Shape] | None = None, margin: float = 0.0, step_ms=None,
                exact_limit: int = EXACT_LIMIT) -> StepPlan:
    """One shape per group for the next steps: the assignment with the most expected committed
    tokens per ms, every request of a group taking its group's shape (the batch stays
    homogeneous: one drafter bucket, one rows pattern per step).

    step_ms(shapes) → ms: the step time of an assignment (default: ``cost.step_counts`` over the
    groups' counts; the planner passes its measured correction). current: the assignment in
    force; it is kept unless the best beats it by more than ``margin`` (relative; hysteresis
    against flapping between near-equal shapes). Search: every joint choice when they number
    ≤ ``exact_limit`` (one adaptive group: its ≤ 8 shapes), otherwise coordinate ascent from the
    best of ``current`` and the uniform assignments until no group's change helps. Cost:
    O(candidates · groups), independent of the number of requests. An empty ``groups``: an
    empty plan."""
    if not groups:
        return StepPlan((), 0.0, 0.0)
    if step_ms is None:
        def step_ms(shapes):
            return cost.step_counts(zip(shapes, (g.count for g in groups)))

    def score(shapes) -> StepPlan:
        return StepPlan(tuple(shapes), group_tokens(shapes, groups, reference), step_ms(shapes))

    options = [g.options for g in groups]
    n_joint = 1
    for o in options:
        n_joint *= len(o)
    if n_joint <= exact_limit:
        best = max((score(a) for a in itertools.product(*options)), key=lambda p: p.tokens_per_ms)
    else:  # from the best uniform assignment (a group without the shape: its largest option below it)
        starts = [list(current)] if current is not None else []
        for u in sorted({s for o in options for s in o}):
            starts.append([u if u in o else max((s for s in o if s.nodes <= u.nodes), key=lambda s: s.nodes,
                                                 default=o[0]) for o in options])
        best = max((score(a) for a in starts), key=lambda p: p.tokens_per_ms)
        improved = True
        while improved:
            improved = False
            for k, o in enumerate(options):
                for s in o:
                    if s is best.shapes[k]:
                        continue
                    cand = score(best.shapes[:k] + (s,) + best.shapes[k + 1:])
                    if cand.tokens_per_ms > best.tokens_per_ms * (1 + 1e-12):
                        best, improved = cand, True
    if current is not None and tuple(current) != best.shapes:
        kept = score(current)
        if best.tokens_per_ms <= kept.tokens_per_ms * (1.0 + margin):
            return kept
    return best
