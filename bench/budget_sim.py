"""The adaptive budget planner (``orchestrator.adaptive.BudgetPlanner``) in a simulated round
loop on the H200 cost model: how often it re-plans, what a plan costs on this machine's CPU,
how many rounds its acceptance estimates push to one-token, and the modelled tok/s of the
rounds it chose against fixed trees.

python -m bench.budget_sim [--rounds 3000] [--weights 0.2,0.05]

Requests: c adaptive tree requests (cap 64), half at 1.3× the reference acceptance and half at
0.75× (HumanEval-like and MT-Bench-like prompts); a round of shape s accepts
round(Exp(level · reference[s])) drafts, capped at s's nodes (a spread about as wide as the
mean, like greedy acceptance counts). Rounds go request by request at the measured
through-services rate (rounds/s of tree@16 at that c, bench/results/concurrency_h200.md) on a
simulated clock; modelled tok/s = tokens ÷ Σ each round's share of a uniform step of c such
rounds (``H200_COSTS``); plan time is measured but not charged. A model, not a measurement.
"""
from __future__ import annotations

import argparse
import random
import time

from orchestrator.adaptive import BudgetPlanner
from orchestrator.budget import H200_BENCH_ACCEPTED, H200_COSTS
from protocol.types import Mode

ROUNDS_PER_S = {1: 230, 4: 550, 16: 1150, 64: 1900}  # tree@16 through the services, rounded


def simulate(c: int, weight: float, rounds: int, fixed: int | None = None, seed: int = 0) -> dict:
    rng, now = random.Random(seed), [0.0]
    p = BudgetPlanner(H200_COSTS, clock=lambda: now[0])
    tickets = [p.join(Mode.TREE, fixed or 64, adaptive=fixed is None) for _ in range(c)]
    for t in tickets:
        t.estimate.weight = weight
    levels = [(1.3, 0.75)[i % 2] for i in range(c)]
    tokens = ms = plan_s = 0.0
    one_token = 0
    for i in range(rounds):
        k = i % c
        t0, plans = time.perf_counter(), p.plans
        s = p.next_shape(tickets[k])
        if p.plans != plans:
            plan_s += time.perf_counter() - t0
        accepted = 0
        if s.drafts:
            mean = min(levels[k] * H200_BENCH_ACCEPTED[s], s.nodes)
            accepted = min(int(rng.expovariate(1 / mean) + 0.5), s.nodes)
        else:
            one_token += 1
        p.observe(tickets[k], s, float(accepted) if s.drafts else None)
        tokens += 1 + accepted
        ms += H200_COSTS.step([s] * c) / c
        now[0] += 1 / ROUNDS_PER_S[c]
    return dict(tok_s=1000 * tokens / ms, one_token=one_token / rounds,
                plans_per_s=p.plans / (rounds / ROUNDS_PER_S[c]), plan_ms=1000 * plan_s / max(p.plans, 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--weights", default="0.2,0.05", help="AcceptanceEstimate weights to compare")
    args = ap.parse_args(argv)
    print("| c | planner | modelled tok/s | one-token rounds | plans/s | ms/plan (this CPU) |")
    print("|---|---|---|---|---|---|")
    for c in sorted(ROUNDS_PER_S):
        for b in (16, 64):
            r = simulate(c, 0.05, args.rounds, fixed=b)
            print(f"| {c} | fixed tree@{b} | {r['tok_s']:.0f} | 0% | | |")
        for w in (float(x) for x in args.weights.split(",")):
            r = simulate(c, w, args.rounds)
            print(f"| {c} | adaptive, weight {w} | {r['tok_s']:.0f} | {r['one_token']:.0%} | {r['plans_per_s']:.1f} "
                  f"| {r['plan_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
