"""The adaptive budget planner (``orchestrator.adaptive.BudgetPlanner``) in a simulated closed
loop: modelled tok/s of adaptive requests against every fixed shape at c = 1, 4, 16, 64, when
the planner's cost model is right and when the serving path's real costs differ from it (the
online correction of measured round times).

python -m bench.budget_sim [--seconds 10] [--warmup 2] [--out bench/results/budget_sim_cpu.md]
python -m bench.budget_sim --bench-like --slowdown --seconds 12 --warmup 4 [--out bench/results/budget_sim_slowdown_cpu.md]

The loop: c requests in lock step (one step = one round of every live request, the workers'
batches); a step of shapes s_1…s_c takes ``true.step(shapes)`` ms (a ``CostModel``: the
H200 through-services fit, or that fit with changed terms) × a log-normal noise (σ 0.1); a
round of shape s accepts round(Exp(level · reference[s])) drafts, at most s's nodes (a spread
about as wide as the mean, like greedy acceptance counts) and commits those + 1; a request
ends after 43 rounds (128 tokens at τ 3) and a new one joins (the first ones end at staggered
rounds). The planner runs on the simulated clock with ``prior`` as its cost model and measures
the simulated round times like the real ones. tok/s = tokens committed after ``warmup``
simulated seconds ÷ the simulated seconds after it (the bench's 2 s warm-up + 8 s cell). Plan
and round CPU is measured on this machine but not charged. A model, not a measurement.
"""
from __future__ import annotations

import argparse
import logging
import random
import time
from collections import Counter
from dataclasses import replace

import structlog

from orchestrator.adaptive import BudgetPlanner
from orchestrator.budget import H200_BENCH_ACCEPTED, H200_COSTS, ONE_TOKEN, CostModel, Shape, reference_accepted, tree
from protocol.types import Mode

ROUNDS_PER_S = {1: 230, 4: 550, 16: 1150, 64: 1900}  # tree@16 through the services on the H200, rounded
FIXED = (ONE_TOKEN, tree(4), tree(16), tree(64))  # the fixed shapes an adaptive request capped at 64 can take
ROUNDS_PER_REQUEST = 43
PROMPTS = 10  # bench.concurrency's prompt set: 5 HumanEval, then 5 MT-Bench


def simulate(c: int, true: CostModel = H200_COSTS, prior: CostModel = H200_COSTS, fixed: Shape | dict | None = None,
             seconds: float = 10.0, warmup: float = 2.0, levels=(1.0,), cap: int = 64, learn: bool = True,
             noise: float = 0.1, seed: int = 0, planner: BudgetPlanner | None = None, ramp: bool = False,
             slow: tuple[float, float] = (0.0, 1.0), ramp_share: float = 1.0, by_prompt: bool = False,
             request_tokens: int | None = None, host=None, **planner_kw) -> dict:
    """One cell: c closed-loop requests, adaptive (cap ``cap``) or all ``fixed`` (a dict: level →
    shape, each request the shape of its own level: a policy per acceptance class); request i's
    acceptance level is levels[i % len(levels)] for stream i (``by_prompt``: request j of stream k
    runs prompt k + j of ``PROMPTS`` as bench.concurrency walks them, and its level is the level of
    that prompt's share of the set — levels (1.3, 0.75): the first half (HumanEval) 1.3, the
    second (MT-Bench) 0.75 — so every stream alternates kinds, c=1 too). ``planner``: continue an existing planner (the
    bench runs every cell on one orchestrator; its clock must read the module's ``CLOCK``);
    ``ramp``: stream k starts at ramp_share · warmup · k / c (bench.concurrency's staggered
    starts) instead of all at 0; every request leaves at the end (the bench cancels what is open).
    A request ends after ``ROUNDS_PER_REQUEST`` rounds, or (``request_tokens``) once it committed
    that many tokens — bench.concurrency's fixed ``--max-tokens``: then a shape that commits fewer
    tokens per round keeps its request live for more rounds. ``slow``:
    (probability, factor) of a step that takes factor × longer (a prefill riding in it, a pause).
    ``host``: t → the host's slowdown factor t simulated seconds into the cell (every step's time ×
    it: a host that slows down under the run, hitting every shape alike; None: 1). Returns tok_s,
    the adaptive rounds' shape shares after warm-up, plans, steps, the last plan's
    shapes, planner CPU µs per round."""
    rng = random.Random(seed)
    now = CLOCK
    start = now[0]
    p = planner or BudgetPlanner(prior, clock=lambda: now[0], learn=learn, **planner_kw)

    def join(k: int):
        served[k] += 1
        f = fixed.get(level_of(k)) if isinstance(fixed, dict) else fixed
        if f is None:
            return p.join(Mode.TREE, cap, adaptive=True)
        return p.join(Mode.AUTOREGRESSIVE, 0) if f == ONE_TOKEN else p.join(Mode.TREE, f.nodes)

    starts = [start + (ramp_share * warmup * k / c if ramp else 0.0) for k in range(c)]
    live: list[list] = [[None, 0] for _ in range(c)]  # per stream: [ticket or None (not started), rounds/tokens left]
    length = request_tokens or ROUNDS_PER_REQUEST
    served = [0] * c  # requests started per stream

    def level_of(k: int) -> float:  # the acceptance level of stream k's current request
        if not by_prompt:
            return levels[k % len(levels)]
        return levels[((k + served[k] - 1) % PROMPTS) * len(levels) // PROMPTS]
    tokens, shares, steps, cpu = 0, Counter(), 0, 0.0
    while now[0] < start + seconds:
        for k in range(c):
            if live[k][0] is None and now[0] >= starts[k]:
                live[k] = [join(k), rng.randrange(1, length + 1) if not ramp else length]
        running = [(k, t) for k, (t, _) in enumerate(live) if t is not None]
        t0 = time.process_time()
        shapes = [p.next_shape(t) for _, t in running]
        cpu += time.process_time() - t0
        ms = true.step([p._priced(s) for s in shapes]) * rng.lognormvariate(0.0, noise)
        if rng.random() < slow[0]:
            ms *= slow[1]
        if host is not None:
            ms *= host(now[0] - start)
        measuring = now[0] >= start + warmup
        for (k, t), s in zip(running, shapes):
            accepted = 0
            if s.drafts:
                mean = min(level_of(k) * reference_accepted(H200_BENCH_ACCEPTED, p._priced(s)), s.nodes)
                accepted = min(int(rng.expovariate(1 / mean) + 0.5), s.nodes) if mean > 0 else 0
            t0 = time.process_time()
            p.observe(t, s, float(accepted) if s.drafts else None)
            live[k][1] -= 1 + accepted if request_tokens else 1
            if live[k][1] <= 0:
                p.leave(t)
                live[k] = [join(k), length]
            cpu += time.process_time() - t0
            if measuring:
                tokens += 1 + accepted
                if fixed is None or isinstance(fixed, dict):
                    shares[str(s)] += 1
        now[0] += ms / 1000.0
        steps += 1
    for t, _ in live:
        if t is not None:
            p.leave(t)
    total = sum(shares.values()) or 1
    return dict(tok_s=tokens / (seconds - warmup), shares={k: v / total for k, v in shares.most_common()},
                plans=p.plans, steps=steps, last=tuple(map(str, p.last.shapes)) if p.last else (),
                cpu_us_per_round=1e6 * cpu / max(steps * c, 1))


#: the simulated clock (s) every cell advances; one list so cells sharing a planner share it too
CLOCK = [0.0]


class MeasuredSteps:
    """A serving path's true step time from a ``bench.concurrency`` run instead of a cost model:
    T(s, n) ms for n requests of shape s = c · τ / tok/s of the run's fixed cells, interpolated
    log-log in n between the run's c values; a shape the run lacks, as another run's ratio to a
    shape the run has (``borrow``). A mixed step costs the
    count-weighted mean of its shapes' uniform step times at n. A model of a measurement, as
    rough as its interpolation (between c = 4 and 16 especially)."""

    def __init__(self, path: str | tuple[str, ...], borrow: dict | None = None):
        """path: the run's json (several: one run's parts, e.g. its low and high c); a cell
        repeated is the mean of its repeats' step times; borrow: {shape the run lacks: (like
        shape, {c: T(shape) / T(like)})}."""
        import json
        import math

        from bench.cost_fit import shape_of

        self.log, self.table, cells = math.log, {}, {}
        for one in (path,) if isinstance(path, str) else path:
            for r in json.load(open(one))["rows"]:
                s = shape_of(r["config"], H200_COSTS.block_size)
                if s is not None and r["tok_s"]:
                    cells.setdefault((s, r["c"]), []).append(r["c"] * r["tau"] / r["tok_s"] * 1000.0)
        for (s, c), ms in cells.items():
            self.table.setdefault(s, {})[c] = sum(ms) / len(ms)
        for s, (like, ratio) in (borrow or {}).items():
            self.table[s] = {c: ms * ratio[c] for c, ms in self.table[like].items() if c in ratio}

    def uniform(self, s: Shape, n: float) -> float:
        pts = sorted(self.table[s].items())
        x = self.log(n)
        k = next((i for i, (c, _) in enumerate(pts) if c >= n), len(pts) - 1)
        k = max(k, 1)
        (c0, t0), (c1, t1) = pts[k - 1], pts[k]
        return t0 * (t1 / t0) ** ((x - self.log(c0)) / (self.log(c1) - self.log(c0)))

    def step(self, shapes) -> float:
        n = len(shapes)
        return sum(self.uniform(s, n) * k for s, k in Counter(shapes).items()) / n if n else 0.0


#: tree@4's step time ÷ tree@16's per c in the one H200 run that had both (53866cc, session 5, gRPC)
TREE4_PER_TREE16 = {1: 0.9925, 4: 0.9678, 16: 0.9279, 64: 0.8534}
#: the session-6 H200 run (8ade7f6, data channel): AR, tree@16, tree@64 measured, tree@4 borrowed
SESSION6 = ("bench/results/concurrency_h200_s6.json", {tree(4): (tree(16), TREE4_PER_TREE16)})
#: the session-7 H200 run (b187233, data channel, 10-s cells), the same configurations
SESSION7 = ("bench/results/concurrency_h200_s7.json", {tree(4): (tree(16), TREE4_PER_TREE16)})
#: session 25's first H200 run (the rule's run, 5-s cells, 3 repeats: every fixed shape at every c)
SESSION25 = (("bench/results/concurrency_h200_s25_low.json", "bench/results/concurrency_h200_s25_high.json"), None)

# Serving paths whose costs differ from the H200 fit the planner starts from (``prior``):
H = H200_COSTS
SCENARIOS = {
    "H200 fit (the planner's model is right)": H,
    "wire 5x cheaper (step_ms, spec_step_ms ÷ 5: a Unix-socket data channel; the best shapes stay)":
        replace(H, step_ms=H.step_ms / 5, spec_step_ms=H.spec_step_ms / 5),
    "verify rows 10x dearer (a larger target: the best shapes move to tree@16 at c=1, tree@4 at c >= 16)":
        replace(H, verify_ms=tuple((r, H.verify_ms[0][1] + 10 * (ms - H.verify_ms[0][1])) for r, ms in H.verify_ms)),
    "host work per row 4x dearer (tree@4 best at c=64)": replace(H, host_ms_per_row=4 * H.host_ms_per_row),
}


def table(true: CostModel, levels, seconds: float, warmup: float, seed: int) -> list[str]:
    out = ["| c | " + " | ".join(f"{s}" for s in FIXED) + " | adaptive | ÷ best fixed | adaptive, model only "
           "| ÷ best fixed | adaptive rounds (learning) | plans | planner µs/round |",
           "|---" * (len(FIXED) + 8) + "|"]
    for c in sorted(ROUNDS_PER_S):
        fixed = {s: simulate(c, true, fixed=s, seconds=seconds, warmup=warmup, levels=levels, seed=seed)["tok_s"]
                 for s in FIXED}
        best = max(fixed.values())
        ad = simulate(c, true, seconds=seconds, warmup=warmup, levels=levels, seed=seed)
        off = simulate(c, true, seconds=seconds, warmup=warmup, levels=levels, seed=seed, learn=False)
        shares = ", ".join(f"{k} {v:.0%}" for k, v in ad["shares"].items() if v >= 0.005)
        out.append(f"| {c} | " + " | ".join(f"{fixed[s]:.0f}" for s in FIXED)
                   + f" | {ad['tok_s']:.0f} | {ad['tok_s'] / best:.3f} | {off['tok_s']:.0f} | {off['tok_s'] / best:.3f} "
                   f"| {shares} | {ad['plans']} | {ad['cpu_us_per_round']:.1f} |")
    return out


def bench_like(true, prior: CostModel = H200_COSTS, cs=(1, 4, 16, 64), seconds: float = 12.0, warmup: float = 4.0,
               levels=(1.0,), seed: int = 0, fixed=FIXED, slow=(0.0, 1.0), noise: float = 0.1,
               ramp_share: float = 1.0, by_prompt: bool = False, request_tokens: int | None = None,
               host=None, repeats: int = 1, **planner_kw) -> list[dict]:
    """bench.concurrency's order on one orchestrator: for each c the fixed cells, then the adaptive
    cell on the one planner every adaptive cell shares (it keeps its plan and measurements from
    the cells before), streams starting over ``ramp_share`` of the warm-up, ``seconds`` measured
    after ``warmup``. ``repeats``: each c's cells that many times, interleaved as ``bench.concurrency
    --repeat`` does (the order as given, then reversed, …; repeat r > 0 draws seed + 1000 r);
    ``host``: (t, r) → the host's slowdown factor t s into a cell of repeat r (``simulate``'s host).
    Returns per c: the fixed cells' tok/s (mean over the repeats), the adaptive cell's result (over
    the repeats: mean tok/s, ``per_repeat`` tok/s, mean shares), its ratio to the best fixed (None
    without fixed cells)."""
    planner = BudgetPlanner(prior, clock=lambda: CLOCK[0], **planner_kw)
    out = []
    for c in cs:
        kw = dict(seconds=seconds + warmup, warmup=warmup, levels=levels, ramp=True, slow=slow, noise=noise,
                  ramp_share=ramp_share, by_prompt=by_prompt, request_tokens=request_tokens)
        fx, ads = {str(s): [] for s in fixed}, []
        for r in range(repeats):
            h = (lambda t, r=r: host(t, r)) if host is not None else None
            cells = [*fixed, None]
            for s in cells if r % 2 == 0 else cells[::-1]:
                if s is None:
                    ads.append(simulate(c, true, prior, planner=planner, host=h, seed=seed + 1000 * r, **kw))
                else:
                    fx[str(s)].append(simulate(c, true, prior, fixed=s, host=h, seed=seed + 1000 * r, **kw)["tok_s"])
        fx = {k: sum(v) / len(v) for k, v in fx.items()}
        ad = ads[0] if repeats == 1 else dict(
            ads[-1], tok_s=sum(a["tok_s"] for a in ads) / repeats, per_repeat=[a["tok_s"] for a in ads],
            shares={k: sum(a["shares"].get(k, 0.0) for a in ads) / repeats for k in {k for a in ads for k in a["shares"]}})
        best = max(fx, key=fx.get) if fx else None
        out.append(dict(c=c, fixed=fx, adaptive=ad, best=best, ratio=ad["tok_s"] / fx[best] if fx else None))
    return out


#: the session-6 planner's correction (no ``near`` filter, fixed optimism, no shrinkage), for comparison
SESSION6_PLANNER = dict(near=1e9, trust=False, shape_sd=1e9)


def bench_like_table(true, levels, seconds: float, warmup: float, seeds, old: bool = True, **kw) -> list[str]:
    """Per c: the fixed cells (seed 0), adaptive (seed 0) and its ratio to the best fixed per seed,
    for this planner and (``old``) the session-6 planner's settings on the same fixed cells."""
    new = [bench_like(true, levels=levels, seconds=seconds, warmup=warmup, seed=seed, **kw) for seed in seeds]
    prev = [bench_like(true, levels=levels, seconds=seconds, warmup=warmup, seed=seed, fixed=(), **kw,
                       **SESSION6_PLANNER) for seed in seeds] if old else []
    out = ["| c | " + " | ".join(str(s) for s in FIXED) + " | adaptive | ÷ best fixed per seed (min) "
           + ("| session-6 planner: ÷ best fixed per seed (min) " if old else "") + "| adaptive rounds after warm-up "
           "(seed 0) |", "|---" * (len(FIXED) + 4 + old) + "|"]
    for k, r in enumerate(new[0]):
        ratios = [run[k]["ratio"] for run in new]
        olds = [run[k]["adaptive"]["tok_s"] / ref[k]["fixed"][ref[k]["best"]] for run, ref in zip(prev, new)]
        shares = ", ".join(f"{n} {v:.0%}" for n, v in r["adaptive"]["shares"].items() if v >= 0.005)
        out.append(f"| {r['c']} | " + " | ".join(f"{v:.0f}" for v in r["fixed"].values())
                   + f" | {r['adaptive']['tok_s']:.0f} | " + " ".join(f"{x:.3f}" for x in ratios) + f" ({min(ratios):.3f}) | "
                   + (" ".join(f"{x:.3f}" for x in olds) + f" ({min(olds):.3f}) | " if old else "") + f"{shares} |")
    return out


#: host slowdowns (the busy H200 lease of session 9: every configuration's round times rose under the run), as
#: bench_like's host(t, r): t s into a cell (4 s warm-up + 12 s), repeat r; every shape's step time × the factor
SLOWDOWNS = {
    "none (control)": (None, 1),
    "ramp: every cost x1.0 -> x1.3 over each cell": (lambda t, r: 1.0 + 0.3 * min(t / 16.0, 1.0), 1),
    "step: every cost x1.25 from the middle of each cell's measured window": (lambda t, r: 1.25 if t >= 10.0 else 1.0, 1),
    "fluctuating: every cost x1.0 / x1.25, alternating every 2 s": (lambda t, r: 1.25 if int(t / 2.0) % 2 else 1.0, 1),
    "busy lease: 4 interleaved repeats, every cost x1.0 -> x1.3 over the whole run":
        (lambda t, r: 1.0 + 0.3 * (r + min(t / 16.0, 1.0)) / 4, 4),
}


def trial_share(shares: dict) -> float:
    """The share of an adaptive cell's measured rounds not at its most frequent shape (trials and flapping)."""
    return 1.0 - max(shares.values(), default=1.0)


def slowdown_table(true, variants: dict, seeds, seconds: float = 12.0, warmup: float = 4.0, scenarios=None) -> list[str]:
    """Per host slowdown (``SLOWDOWNS``) and c: the fixed cells (seed 0) and, per planner variant
    (``variants``: label → BudgetPlanner keywords), adaptive ÷ the best fixed per seed (min, mean) and
    the mean share of its measured rounds off its main shape (``trial_share``); streams over the first
    half of the warm-up (bench.concurrency's --ramp 0.5)."""
    out = []
    for name, (host, repeats) in (scenarios or SLOWDOWNS).items():
        runs = {label: [bench_like(true, seconds=seconds, warmup=warmup, seed=seed, ramp_share=0.5, host=host,
                                   repeats=repeats, **kw) for seed in seeds] for label, kw in variants.items()}
        out += ["", f"### {name}", "", "| c | " + " | ".join(str(s) for s in FIXED) + " | "
                + " | ".join(f"{v}: ÷ best fixed, min / mean | {v}: rounds off its main shape" for v in variants)
                + " |", "|---" * (len(FIXED) + 1 + 2 * len(variants)) + "|"]
        first = next(iter(runs.values()))[0]
        for k, r in enumerate(first):
            cells = []
            for label, rs in runs.items():
                ratios = [run[k]["ratio"] for run in rs]
                trials = [trial_share(run[k]["adaptive"]["shares"]) for run in rs]
                cells.append(f"{min(ratios):.3f} / {sum(ratios) / len(ratios):.3f} | {sum(trials) / len(trials):.1%}")
            out.append(f"| {r['c']} | " + " | ".join(f"{v:.0f}" for v in r["fixed"].values()) + " | "
                       + " | ".join(cells) + " |")
    return out


#: the bench prompts' acceptance split: HumanEval ~1.3x, MT-Bench ~0.75x the reference (plans/0009 Session 7)
CODE_CHAT = (1.3, 0.75)


def split_oracle(true, c: int, levels=CODE_CHAT, seed: int = 0, fixed=FIXED, **kw) -> dict:
    """The upper bound of any policy that gives each acceptance class its own fixed shape: every
    (shape for levels[0], shape for levels[1]) pair as a fixed cell (``simulate(fixed={level:
    shape})``, by prompt). Returns {(shape, shape): tok/s}; the diagonal is the uniform fixed
    shapes."""
    return {(a, b): simulate(c, true, fixed={levels[0]: a, levels[1]: b}, levels=levels, seed=seed, by_prompt=True,
                             **kw)["tok_s"] for a in fixed for b in fixed}


def split_table(true, seconds: float, warmup: float, seeds, request_tokens: int | None) -> list[str]:
    """The code/chat split (``CODE_CHAT`` by prompt, as bench.concurrency walks its prompts), per c:
    the fixed cells (seed 0), the best per-class pair of fixed shapes (``split_oracle``, seed 0)
    ÷ the best uniform shape, and adaptive (one shape per cap) ÷ the best fixed per seed. (Session
    8's planner with acceptance classes, commit 0329f63, added a column: no gain, not kept.)"""
    kw = dict(levels=CODE_CHAT, by_prompt=True, ramp_share=0.5, seconds=seconds, warmup=warmup,
              request_tokens=request_tokens)
    one = [bench_like(true, seed=seed, **kw) for seed in seeds]
    out = ["| c | " + " | ".join(str(s) for s in FIXED) + " | best per-class pair (code, chat) ÷ best uniform "
           "| adaptive: ÷ best fixed per seed (min) | adaptive rounds (seed 0) |", "|---" * (len(FIXED) + 4) + "|"]
    for k, r in enumerate(one[0]):
        c = r["c"]
        oracle = split_oracle(true, c, seconds=seconds + warmup, warmup=warmup, ramp=True, ramp_share=0.5,
                              request_tokens=request_tokens)
        (a, b), top = max(oracle.items(), key=lambda kv: kv[1])
        uni = max(v for (x, y), v in oracle.items() if x == y)
        r1 = [run[k]["ratio"] for run in one]
        shares = ", ".join(f"{n} {v:.0%}" for n, v in r["adaptive"]["shares"].items() if v >= 0.005)
        out.append(f"| {c} | " + " | ".join(f"{v:.0f}" for v in r["fixed"].values())
                   + f" | ({a}, {b}) {top / uni:.3f} | " + " ".join(f"{x:.3f}" for x in r1) + f" ({min(r1):.3f}) | "
                   + f"{shares} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="simulated seconds per cell")
    ap.add_argument("--warmup", type=float, default=2.0, help="simulated seconds not counted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write the tables to this markdown file")
    ap.add_argument("--bench-like", action="store_true",
                    help="bench.concurrency's conditions instead: cells in its order on one planner, streams "
                         "starting over the warm-up, the true costs the session-6 H200 run's measured step times "
                         "(MeasuredSteps), seeds 0-4 (use --seconds 12 --warmup 4)")
    ap.add_argument("--slowdown", action="store_true",
                    help="with --bench-like: only the host slowdowns (SLOWDOWNS: every cost x1.0 -> x1.3 over each "
                         "cell, a x1.25 step, a host alternating x1.0 / x1.25, the busy lease's 4 repeats), the planner "
                         "with and without its common-mode correction, seeds 0-4")
    ap.add_argument("--split", action="store_true",
                    help="with --bench-like: only the code/chat acceptance split (session-7 run's step times, "
                         "requests of a fixed number of rounds and of 128 tokens): every pair of per-class fixed "
                         "shapes against the best uniform one, and the planner")
    ap.add_argument("--steps", action="store_true",
                    help="the --steps on prior (H200_STEPS_COSTS) on three serving paths: its own costs, one-token "
                         "rounds 10 %% cheaper at 64 live (host-bound), tree@16 6 %% ahead there (session 22's first "
                         "steps-on fit); adaptive vs every fixed shape, seeds 0-2")
    ap.add_argument("--rule", action="store_true",
                    help="with --bench-like: the conditions of issue 14's rule run (plans/0009 session 25: 3 "
                         "interleaved repeats, streams over the first half of the warm-up, requests of 128 tokens, "
                         "code/chat acceptance by prompt) on session 25's measured step times, seeds 0-5 (use "
                         "--seconds 5 --warmup 2.5)")
    args = ap.parse_args(argv)
    # the planner's "plan" lines off: a re-plan's wait (``min_interval``, or 100x the re-plan's own CPU time) is
    # read from this machine's clock, and a line rendered to a terminal (~1 ms) stretched it to ~100 ms, past the
    # 50 ms a JSON line (~12 us) leaves it at in the services — the simulated decisions then depended on the console
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.steps:
        return steps_main(args)
    if args.bench_like and args.rule:
        return rule_main(args)
    if args.bench_like and args.split:
        return split_main(args)
    if args.bench_like and args.slowdown:
        return slowdown_main(args)
    if args.bench_like:
        return bench_like_main(args)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python -m bench.budget_sim --seconds "
             f"{args.seconds} --warmup {args.warmup} --seed {args.seed}`; prior = H200_COSTS in every table; "
             "modelled tok/s (simulated, not measured)."]
    for name, true in SCENARIOS.items():
        for levels, what in (((1.0,), "every request at the reference acceptance"),
                             ((1.3, 0.75), "half at 1.3x, half at 0.75x the reference")):
            lines += ["", f"### {name}; {what}", ""] + table(true, levels, args.seconds, args.warmup, args.seed)
            print("\n".join(lines[-(len(ROUNDS_PER_S) + 2):]), flush=True)
    return _written(args, lines)


def steps_main(args) -> int:
    """``--steps``: the steps-on prior on serving paths whose costs differ from it where it matters (c = 64)."""
    from orchestrator.budget import H200_STEPS_COSTS as prior

    paths = {"the prior's own costs": prior,
             "host-bound (host_ms 0.10, spec_host_ms 0.21: one-token ~10 % ahead of tree@16 at 64 live)":
                 replace(prior, host_ms=0.10, spec_host_ms=0.21),
             "session 22's first steps-on fit (tree@16 ~6 % ahead of one-token at 64 live)":
                 replace(prior, step_ms=0.7022, spec_step_ms=1.1378, host_ms=0.134, spec_host_ms=0.1724,
                         host_ms_per_row=0.0026)}
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python -m bench.budget_sim --steps --seconds "
             f"{args.seconds} --warmup {args.warmup}`; prior H200_STEPS_COSTS (fit error {prior.fit_error}), lock-step "
             "rounds, modelled tok/s (simulated, not measured), seeds 0-2."]
    for name, true in paths.items():
        lines += ["", f"### {name}", "", "| c | " + " | ".join(str(s) for s in FIXED)
                  + " | adaptive ÷ best fixed per seed (min) | adaptive rounds (seed 0) |", "|---" * (len(FIXED) + 3) + "|"]
        for c in ROUNDS_PER_S:
            fixed = {s: simulate(c, true, prior, fixed=s, seconds=args.seconds, warmup=args.warmup)["tok_s"]
                     for s in FIXED}
            best = max(fixed.values())
            runs = [simulate(c, true, prior, seconds=args.seconds, warmup=args.warmup, seed=seed) for seed in range(3)]
            ratios = [r["tok_s"] / best for r in runs]
            shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(runs[0]["shares"].items(), key=lambda kv: -kv[1]))
            lines.append(f"| {c} | " + " | ".join(f"{v:.0f}" for v in fixed.values()) + " | "
                         + " ".join(f"{x:.3f}" for x in ratios) + f" ({min(ratios):.3f}) | {shares} |")
            print(lines[-1], flush=True)
    return _written(args, lines)


def bench_like_main(args) -> int:
    true = MeasuredSteps(*SESSION6)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python -m bench.budget_sim --bench-like "
             f"--seconds {args.seconds} --warmup {args.warmup}`; prior H200_COSTS, true step times from the "
             "session-6 H200 run (tree@4 borrowed from session 5's ratio to tree@16); modelled tok/s, seeds 0-4."]
    for what, kw in (("streams start over the whole warm-up (as on the H200 in session 6), step noise σ 0.1", {}),
                     ("the same, 5 % of steps twice as long (prefills riding in them)", dict(slow=(0.05, 2.0))),
                     ("the same, half the requests at 1.3x and half at 0.75x the reference acceptance",
                      dict(levels=(1.3, 0.75))),
                     ("streams start over the first half of the warm-up (bench.concurrency's --ramp 0.5)",
                      dict(ramp_share=0.5, old=False))):
        kw.setdefault("levels", (1.0,))
        lines += ["", f"### {what}", ""] + bench_like_table(true, seconds=args.seconds, warmup=args.warmup,
                                                            seeds=range(5), **kw)
        print("\n".join(lines[-7:]), flush=True)
    return _written(args, lines)


def _written(args, lines: list[str]) -> int:
    """Write ``lines`` to ``--out`` when given; the exit status (0)."""
    if args.out:
        open(args.out, "w").write("\n".join(lines) + "\n")
    return 0


def rule_main(args) -> int:
    """``--bench-like --rule``: the planner under the rule run's conditions, on that run's own step times."""
    true = MeasuredSteps(*SESSION25)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python -m bench.budget_sim --bench-like --rule "
             f"--seconds {args.seconds} --warmup {args.warmup}`; prior H200_COSTS, true step times from session 25's "
             "first H200 run (every fixed shape at every c, the mean of its 3 repeats), 3 interleaved repeats per c "
             "on one planner, streams over the first half of the warm-up, requests of 128 tokens, acceptance by "
             f"prompt (HumanEval {CODE_CHAT[0]}x, MT-Bench {CODE_CHAT[1]}x the reference), step noise σ 0.1; "
             "modelled tok/s, seeds 0-5. A model of the rule's run without the lease's drift."]
    lines += [""] + bench_like_table(true, CODE_CHAT, args.seconds, args.warmup, range(6), old=False, ramp_share=0.5,
                                     by_prompt=True, request_tokens=128, repeats=3)
    print("\n".join(lines), flush=True)
    return _written(args, lines)


def slowdown_main(args) -> int:
    true = MeasuredSteps(*SESSION6)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python -m bench.budget_sim --bench-like --slowdown "
             f"--seconds {args.seconds} --warmup {args.warmup}`; prior H200_COSTS, true step times from the session-6 "
             "H200 run (tree@4 borrowed from session 5's ratio to tree@16) × the host's slowdown factor, streams over "
             "the first half of the warm-up; modelled tok/s, seeds 0-4. \"session 9\": the planner comparing raw "
             "figures (`common_mode=False`); \"common-mode\": measurements compared at one host speed (the default)."]
    variants = {"session 9": dict(common_mode=False), "common-mode": {}}
    for name in SLOWDOWNS:
        lines += slowdown_table(true, variants, range(5), args.seconds, args.warmup, {name: SLOWDOWNS[name]})
        print("\n".join(lines[-8:]), flush=True)
    return _written(args, lines)


def split_main(args) -> int:
    true = MeasuredSteps(*SESSION7)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python -m bench.budget_sim --bench-like --split "
             f"--seconds {args.seconds} --warmup {args.warmup}`; prior H200_COSTS, true step times from the "
             "session-7 H200 run (b187233; tree@4 borrowed from session 5's ratio to tree@16; a mixed step costs the "
             "count-weighted mean of its shapes' uniform step times), streams over the first half of the warm-up, "
             f"each request's acceptance by its prompt: HumanEval {CODE_CHAT[0]}x, MT-Bench {CODE_CHAT[1]}x the "
             "reference; modelled tok/s, seeds 0-4."]
    for what, tokens in (("requests of 43 rounds whatever their shape (the simulation's old request model)", None),
                         ("requests of 128 tokens (bench.concurrency's --max-tokens 128 with ignore_eos)", 128)):
        lines += ["", f"### {what}", ""] + split_table(true, args.seconds, args.warmup, range(5), tokens)
        print("\n".join(lines[-7:]), flush=True)
    return _written(args, lines)


if __name__ == "__main__":
    raise SystemExit(main())
