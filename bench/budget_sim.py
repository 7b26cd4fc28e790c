"""The adaptive budget planner (``orchestrator.adaptive.BudgetPlanner``) in a simulated closed
loop: modelled tok/s of adaptive requests against every fixed shape at c = 1, 4, 16, 64, when
the planner's cost model is right and when the serving path's real costs differ from it (the
online correction of measured round times).

python -m bench.budget_sim [--seconds 10] [--warmup 2] [--out bench/results/budget_sim_cpu.md]

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
import random
import time
from collections import Counter
from dataclasses import replace

from orchestrator.adaptive import BudgetPlanner
from orchestrator.budget import H200_BENCH_ACCEPTED, H200_COSTS, ONE_TOKEN, CostModel, Shape, reference_accepted, tree
from protocol.types import Mode

ROUNDS_PER_S = {1: 230, 4: 550, 16: 1150, 64: 1900}  # tree@16 through the services on the H200, rounded
FIXED = (ONE_TOKEN, tree(4), tree(16), tree(64))  # the fixed shapes an adaptive request capped at 64 can take
ROUNDS_PER_REQUEST = 43


def simulate(c: int, true: CostModel = H200_COSTS, prior: CostModel = H200_COSTS, fixed: Shape | None = None,
             seconds: float = 10.0, warmup: float = 2.0, levels=(1.0,), cap: int = 64, learn: bool = True,
             noise: float = 0.1, seed: int = 0, **planner_kw) -> dict:
    """One cell: c closed-loop requests, adaptive (cap ``cap``) or all ``fixed``; request i's
    acceptance level is levels[i % len(levels)]. Returns tok_s, the adaptive rounds' shape
    shares after warm-up, plans, steps, the last plan's shapes, planner CPU µs per round."""
    rng, now = random.Random(seed), [0.0]
    p = BudgetPlanner(prior, clock=lambda: now[0], learn=learn, **planner_kw)

    def join():
        if fixed is None:
            return p.join(Mode.TREE, cap, adaptive=True)
        return p.join(Mode.AUTOREGRESSIVE, 0) if fixed == ONE_TOKEN else p.join(Mode.TREE, fixed.nodes)

    live = [[join(), rng.randrange(1, ROUNDS_PER_REQUEST + 1)] for _ in range(c)]
    tokens, shares, steps, cpu = 0, Counter(), 0, 0.0
    while now[0] < seconds:
        t0 = time.process_time()
        shapes = [p.next_shape(t) for t, _ in live]
        cpu += time.process_time() - t0
        ms = true.step([p._priced(s) for s in shapes]) * rng.lognormvariate(0.0, noise)
        measuring = now[0] >= warmup
        for k, ((t, left), s) in enumerate(zip(live, shapes)):
            accepted = 0
            if s.drafts:
                mean = min(levels[k % len(levels)] * reference_accepted(H200_BENCH_ACCEPTED, p._priced(s)), s.nodes)
                accepted = min(int(rng.expovariate(1 / mean) + 0.5), s.nodes) if mean > 0 else 0
            t0 = time.process_time()
            p.observe(t, s, float(accepted) if s.drafts else None)
            if left <= 1:
                p.leave(t)
                live[k] = [join(), ROUNDS_PER_REQUEST]
            else:
                live[k][1] = left - 1
            cpu += time.process_time() - t0
            if measuring:
                tokens += 1 + accepted
                shares[str(s)] += 1
        now[0] += ms / 1000.0
        steps += 1
    total = sum(shares.values()) or 1
    return dict(tok_s=tokens / (seconds - warmup), shares={k: v / total for k, v in shares.most_common()},
                plans=p.plans, steps=steps, last=tuple(map(str, p.last.shapes)) if p.last else (),
                cpu_us_per_round=1e6 * cpu / max(steps * c, 1))


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="simulated seconds per cell")
    ap.add_argument("--warmup", type=float, default=2.0, help="simulated seconds not counted")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="also write the tables to this markdown file")
    args = ap.parse_args(argv)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python -m bench.budget_sim --seconds "
             f"{args.seconds} --warmup {args.warmup} --seed {args.seed}`; prior = H200_COSTS in every table; "
             "modelled tok/s (simulated, not measured)."]
    for name, true in SCENARIOS.items():
        for levels, what in (((1.0,), "every request at the reference acceptance"),
                             ((1.3, 0.75), "half at 1.3x, half at 0.75x the reference")):
            lines += ["", f"### {name}; {what}", ""] + table(true, levels, args.seconds, args.warmup, args.seed)
            print("\n".join(lines[-(len(ROUNDS_PER_S) + 2):]), flush=True)
    if args.out:
        open(args.out, "w").write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
