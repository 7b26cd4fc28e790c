"""What issue 14's rule can decide on a lease: how often it holds for a planner of known gain.

python -m bench.rule_power [--runs s25_low,s25_high,s25b_low,s25b_high] [--repeats 3,5,8,12]
    [--gains 1.0,1.02] [--trials 300] [--out bench/results/rule_power.md]

The rule (plans/0009 "Session 25", ``bench.concurrency.repeat_summary``'s ``rule``): at a
concurrency c, adaptive holds against the best fixed budget when the ratio of its mean tok/s to
the best fixed configuration's mean (the best chosen by mean over the run's repeats) is at least
``RULE_RATIO`` and the paired bootstrap 90 % interval of that ratio (the best re-chosen in every
resample) reaches 1.

**Power** (``power``): how often the rule holds when adaptive is, in truth, ``gain`` × the best
fixed configuration. A lease's noise is read from the runs given (``lease_noise``): per c, the
fixed configurations' true means (the mean of their cells over the runs) and the per-cell noise
(the pooled standard deviation of log tok/s between repeats of the same configuration in the
same run). Synthetic runs draw each cell as true mean × exp(N(0, σ_c²)) — independent cells, in
the bench's interleaved order (the order does not matter to independent noise; a lease that
drifts under a run is worse) — and are judged by ``repeat_summary`` itself, so the power is the
rule's as the bench applies it. Without noise an exactly equal planner still fails the rule
now and then: its interval must reach 1, and with a few repeats every one of them can fall a
hair below (a sign test); the table's noiseless rows show how often.

What the runs say together, without the rule's per-run best-of-several (the winner's curse that
makes a planner exactly equal to the best fixed score below 1 on the rule's ratio of means):
``python -m bench.concurrency_pool RUNS`` (adaptive ÷ a comparator named beforehand, paired
within each repeat; its per-run columns count each lease once). A model of the rule, not a
measurement.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections import defaultdict

from bench.concurrency import RULE_RATIO, by_cell, repeat_summary

RESULTS = "bench/results/concurrency_h200_{}.json"
NOISELESS = 0.001  # per-cell σ of "a noiseless lease"


def _rows(tag: str) -> list[dict]:
    """A run's rows: ``tag`` names bench/results/concurrency_h200_<tag>.json, or is a .json path."""
    return json.load(open(tag if tag.endswith(".json") else RESULTS.format(tag)))["rows"]


def _fixed(config: str) -> bool:
    return config != "autoregressive" and not config.startswith("adaptive")


def lease_noise(tags: list[str]) -> dict[int, dict]:
    """Per c: ``sigma`` = the pooled standard deviation of log tok/s between repeats of one fixed
    configuration within one run (pooled over configurations and runs), ``means`` = each fixed
    configuration's mean tok/s over every cell of the runs. Raises ValueError when a c has no
    repeated fixed cell."""
    cells, means = defaultdict(list), defaultdict(list)
    for tag in tags:
        for (config, c), reps in by_cell(_rows(tag)).items():
            values = [v for v in reps.values() if v > 0]
            if _fixed(config) and values:
                means[c, config] += values
                if len(values) > 1:
                    cells[c].append([math.log(v) for v in values])
    out = {}
    for c in sorted({c for c, _ in means}):
        groups = cells.get(c)
        if not groups:
            raise ValueError(f"no repeated fixed cell at c={c} in {tags}")
        ss = sum(sum((x - statistics.fmean(g)) ** 2 for x in g) for g in groups)
        dof = sum(len(g) - 1 for g in groups)
        out[c] = dict(sigma=math.sqrt(ss / dof), dof=dof,
                      means={k: statistics.fmean(v) for (cc, k), v in means.items() if cc == c})
    return out


def power(means: dict[str, float], sigma: float, repeats: int, gain: float = 1.0, trials: int = 300,
          resamples: int = 400, seed: int = 0) -> float:
    """The share of ``trials`` synthetic runs (fixed configurations at ``means`` tok/s, adaptive at
    ``gain`` × the largest, every cell × exp(N(0, sigma²)), ``repeats`` repeats) in which
    ``repeat_summary`` says the rule holds."""
    best = max(means.values())
    names, held = [*means, "adaptive"], 0
    for t in range(trials):
        rng, rows = random.Random(seed + t), []
        for r in range(repeats):
            for n in names if r % 2 == 0 else names[::-1]:
                mu = gain * best if n == "adaptive" else means[n]
                rows.append(dict(config=n, c=0, rep=r, tok_s=mu * math.exp(rng.gauss(0.0, sigma))))
        held += repeat_summary(rows, resamples=resamples, seed=seed + t)[0]["rule"] == "holds"
    return held / trials


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="s25_low,s25_high,s25b_low,s25b_high",
                    help="runs (tags of bench/results/concurrency_h200_<tag>.json) the lease's noise is read from")
    ap.add_argument("--repeats", default="3,5,8,12")
    ap.add_argument("--gains", default="1.0,1.02")
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    runs, repeats = args.runs.split(","), [int(r) for r in args.repeats.split(",")]
    noise = lease_noise(runs)
    lines = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `python -m bench.rule_power --runs {args.runs} "
             f"--repeats {args.repeats} --gains {args.gains} --trials {args.trials}`", "",
             f"### How often the rule (ratio of means ≥ {RULE_RATIO}, 90 % interval reaching 1) holds, by the true gain "
             "of adaptive over the best fixed configuration", "",
             "Lease noise from the runs above: per-cell σ of log tok/s (pooled over fixed configurations and runs; "
             "degrees of freedom), the fixed configurations' means. Synthetic runs of independent cells, judged by "
             "`bench.concurrency.repeat_summary`; \"all four\": the product over c (one run decides every c).", "",
             "| true adaptive ÷ best fixed | repeats | " + " | ".join(f"c = {c}" for c in noise) + " | all four |",
             "|---" * (len(noise) + 3) + "|",
             "| (per-cell σ, dof) | | " + " | ".join(f"{v['sigma']:.3f} ({v['dof']})" for v in noise.values()) + " | |"]
    print("\n".join(lines), flush=True)
    for gain in (float(g) for g in args.gains.split(",")):
        for r in repeats:
            p = {c: power(v["means"], v["sigma"], r, gain, args.trials) for c, v in noise.items()}
            lines.append(f"| {gain:.2f} | {r} | " + " | ".join(f"{x:.2f}" for x in p.values())
                         + f" | {math.prod(p.values()):.2f} |")
            print(lines[-1], flush=True)
    for r in repeats:  # the interval's part alone: "reaches 1" fails an equal planner whose every repeat is a hair below
        p = {c: power(v["means"], NOISELESS, r, 1.0, args.trials) for c, v in noise.items()}
        lines.append(f"| 1.00, a noiseless lease (σ {NOISELESS}) | {r} | " + " | ".join(f"{x:.2f}" for x in p.values())
                     + f" | {math.prod(p.values()):.2f} |")
        print(lines[-1], flush=True)
    if args.out:
        open(args.out, "w").write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
