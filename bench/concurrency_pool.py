"""Adaptive ÷ a fixed configuration, pooled over several ``bench.concurrency`` runs (issue 14,
plans/0009 "Session 14"): one ratio per repeat — adaptive's tok/s over the named configuration's in
the same repeat of the same run (cells of one repeat run back to back, so host drift hits both
alike) — then, per concurrency c, the mean of those ratios with a normal 90 % interval, the median and
how many are below 1. The interval treats repeats from different leases as one sample: a summary,
not a calibrated test. With the run as the unit instead (``run_mean``: the geometric mean over runs
of each run's geometric mean ratio; ``run_ci90``: a 90 % t interval from the runs' spread), each
lease counts once and the spread between leases widens the interval (session 26); runs made on one
lease are named together with ``--lease A.json,B.json`` (session 27) and count as one.

python3 -m bench.concurrency_pool bench/results/concurrency_h200_s1{1,2,3}.json … \\
    [--against 1:tree@64,4:tree@64,16:tree@16,64:tree@16] [--lease A.json,B.json …] [--margin 0.05] [--out pooled.md]

Prints a markdown table (and writes it with --out); a run lacking adaptive or the named
configuration at some c adds nothing there.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics

from bench.concurrency import by_cell

AGAINST = {1: "tree@64", 4: "tree@64", 16: "tree@16", 64: "tree@16"}  # the H200's best fixed (sessions 8–14)
#: two-sided 90 % t quantiles by degrees of freedom (beyond: 1.645)
T90 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
       12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697}


def paired_ratios(rows: list[dict], c: int, against: str) -> list[float]:
    """Adaptive ÷ ``against`` within each repeat of one run at concurrency c (rows: a
    bench.concurrency json's ``rows``); repeats where either is missing or ``against`` made 0 tok/s
    are skipped."""
    cells = by_cell(rows)
    ad, fx = cells.get(("adaptive", c), {}), cells.get((against, c), {})
    return [ad[k] / fx[k] for k in sorted(ad) if fx.get(k)]


def _t90(dof: int) -> float:
    """The two-sided 90 % t quantile at ``dof`` ≥ 1 (between tabled values: the next smaller's, conservative)."""
    return T90.get(dof) or T90[max(k for k in T90 if k < dof)]


def pool(runs: dict[str, list[dict]], against: dict[int, str], lease: dict[str, str] | None = None) -> list[dict]:
    """Per c of ``against``: the paired ratios of every run (``runs``: name → rows), their
    mean, a normal 90 % interval of the mean (None below 2 ratios), median, count below 1,
    the runs that contributed (name, ratios) and, a lease counted once, ``run_mean`` (geometric
    mean over leases of each lease's geometric mean ratio: the mean of its runs' log means) with
    ``run_ci90`` (t interval; None below 2 leases) and ``leases`` (how many). ``lease``: run name →
    lease name for runs that shared a machine (two runs of one lease at one c are one sample of
    the lease-to-lease spread, not two); a run not in it is a lease of its own."""
    lease = lease or {}
    out = []
    for c, cfg in against.items():
        per_run = [(name, paired_ratios(rows, c, cfg)) for name, rows in runs.items()]
        per_run = [(name, r) for name, r in per_run if r]
        xs = [x for _, r in per_run for x in r]
        if not xs:
            continue
        m = statistics.fmean(xs)
        half = 1.645 * statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None
        by_lease: dict[str, list[float]] = {}
        for name, r in per_run:
            by_lease.setdefault(lease.get(name, name), []).append(statistics.fmean(math.log(x) for x in r))
        logs = [statistics.fmean(v) for v in by_lease.values()]
        lm = statistics.fmean(logs)
        rhalf = _t90(len(logs) - 1) * statistics.stdev(logs) / len(logs) ** 0.5 if len(logs) > 1 else None
        out.append(dict(c=c, against=cfg, n=len(xs), mean=m, ci90=None if half is None else (m - half, m + half),
                        median=statistics.median(xs), below_1=sum(x < 1 for x in xs),
                        runs=[(name, len(r)) for name, r in per_run], leases=len(logs), run_mean=math.exp(lm),
                        run_ci90=None if rhalf is None else (math.exp(lm - rhalf), math.exp(lm + rhalf))))
    return out


def non_inferior(p: dict, margin: float) -> bool | None:
    """Whether adaptive is shown no worse than ``against`` by more than ``margin`` (0.05: 5 %): the
    lower end of the runs-counted-once 90 % interval ≥ 1 − margin; None without an interval (one
    run). The decision procedure plans/0009 "Session 26" proposes in place of session 25's rule."""
    return None if p["run_ci90"] is None else p["run_ci90"][0] >= 1.0 - margin


def markdown(pooled: list[dict], margin: float | None = None) -> str:
    verdict = f" non-inferior by {margin:.0%} |" if margin is not None else ""
    lines = ["| c | against | paired repeats | mean ratio | 90 % interval of the mean | median | below 1 | runs | "
             "leases | a lease counted once: geometric mean | its 90 % t interval |" + verdict,
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if verdict else "")]
    for p in pooled:
        ci = "" if p["ci90"] is None else f"{p['ci90'][0]:.3f}–{p['ci90'][1]:.3f}"
        rci = "" if p["run_ci90"] is None else f"{p['run_ci90'][0]:.3f}–{p['run_ci90'][1]:.3f}"
        runs = ", ".join(f"{name} ({k})" for name, k in p["runs"])
        lines.append(f"| {p['c']} | {p['against']} | {p['n']} | {p['mean']:.3f} | {ci} | {p['median']:.3f} | "
                     f"{p['below_1']} | {runs} | {p['leases']} | {p['run_mean']:.3f} | {rci} |"
                     + ({True: " yes |", False: " no |", None: " – |"}[non_inferior(p, margin)] if verdict else ""))
    return "\n".join(lines) + "\n"


def parse_against(text: str) -> dict[int, str]:
    """``1:tree@64,16:tree@16`` → {1: "tree@64", 16: "tree@16"}."""
    try:
        pairs = [item.split(":", 1) for item in text.split(",") if item.strip()]
        out = {int(c): cfg.strip() for c, cfg in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--against: write C:CONFIG[,C:CONFIG…], got {text!r}") from None
    if not out or not all(cfg for cfg in out.values()):
        raise argparse.ArgumentTypeError(f"--against: write C:CONFIG[,C:CONFIG…], got {text!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="bench.concurrency json files")
    p.add_argument("--against", type=parse_against, default=AGAINST,
                   help="C:CONFIG pairs: the fixed configuration adaptive is divided by at each c "
                        "(default: the H200's best fixed, 1:tree@64,4:tree@64,16:tree@16,64:tree@16)")
    p.add_argument("--out", default="", help="also write the table to this markdown file")
    p.add_argument("--margin", type=float, default=None,
                   help="add a verdict column: non-inferior by this margin (0.05: the runs-counted-once interval's "
                        "lower end ≥ 0.95)")
    p.add_argument("--lease", action="append", default=[], metavar="A.json,B.json",
                   help="runs made on one lease (one machine start), counted as one lease; repeatable")
    a = p.parse_args(argv)
    files = list(dict.fromkeys(pathlib.Path(f).expanduser().resolve() for f in a.runs))  # one file named twice: once
    stems = [f.stem for f in files]
    names = [f.stem if stems.count(f.stem) == 1 else str(f) for f in files]
    runs = {}
    for name, f in zip(names, files):
        try:
            runs[name] = json.loads(f.read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"{f}: not a bench.concurrency json with rows ({type(e).__name__}: {e})")
    name_of = dict(zip(files, names))
    lease = {}
    for i, group in enumerate(a.lease):
        members = {pathlib.Path(f.strip()).expanduser().resolve() for f in group.split(",") if f.strip()}
        missing = sorted(str(f) for f in members - name_of.keys())
        if missing:
            p.error(f"--lease names runs not given as positional runs: {', '.join(missing)}")
        twice = sorted(str(f) for f in members if name_of[f] in lease)
        if twice:
            p.error(f"--lease: a run is in two lease groups (merge them): {', '.join(twice)}")
        for f in members:
            lease[name_of[f]] = f"--lease #{i + 1}"  # (not a run's name: a lone run is its own lease by name)
    md = markdown(pool(runs, a.against, lease), a.margin)
    print(md, end="")
    if a.out:
        pathlib.Path(a.out).write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
