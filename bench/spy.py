"""Sampled profiles of the services over a bench cell (py-spy), and where two configurations differ.

``bench.concurrency --py-spy DIR`` records, over each cell (from the scrape of the services'
counters before its warm-up to the one after its drain: the span its round counts cover), every service's
Python stacks with py-spy (a sampling profiler outside the process: ``--nonblocking``, the
process is never paused; ``--gil``: only samples holding the GIL, i.e. Python work, not waits)
into DIR/c<c>_<config>_r<rep>_<service>.txt (py-spy's "raw" format: one collapsed stack and
its sample count per line). Needs the ``py-spy`` binary on PATH (``pip install py-spy``: a
static binary; on the device, carried as a wheel, ``scripts/device_prep.sh``).

python -m bench.spy RUN.json --c 64 --a tree@16 --b adaptive@16 [--service orchestrator] [--top 25]

compares two configurations at one c: per function, the CPU µs per round it ran itself and
with its callees, summed over the configuration's repeats and divided by their rounds (the
orchestrator's round counters of the same cells), for each and B − A; the largest differences
first. Why: the H200 c = 64 cells run the orchestrator at ~80 % of a step (plans/0009 "Session
26"), so a few µs per round of work one configuration does and the other does not shows there
as throughput; the stub benches could not resolve it.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import signal
import subprocess
from collections import Counter

SERVICES = ("orchestrator", "target", "draft")


def cell_stem(c: int, config: str, rep: int) -> str:
    """The file name prefix of one cell's profiles."""
    return f"c{c}_{config.replace('@', '-')}_r{rep}"


def start(pids: dict[str, int], out_dir: str, stem: str, rate: int = 200) -> dict[str, tuple]:
    """py-spy recording each service (name → pid) until ``finish``; returns name → (Popen, path).
    Raises FileNotFoundError naming py-spy when it is not on PATH."""
    exe = shutil.which("py-spy")
    if exe is None:
        raise FileNotFoundError("--py-spy needs the py-spy binary on PATH (pip install py-spy)")
    out = {}
    for name, pid in pids.items():
        path = str(pathlib.Path(out_dir) / f"{stem}_{name}.txt")
        cmd = [exe, "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--nonblocking", "--gil",
               "--subprocesses", "--output", path]
        out[name] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), path)
    return out


def finish(spies: dict[str, tuple], timeout: float = 30.0) -> dict[str, str]:
    """Stop the recordings (SIGINT: py-spy writes what it sampled); name → file name of those
    that wrote one."""
    done = {}
    for proc, _ in spies.values():
        proc.send_signal(signal.SIGINT)
    for name, (proc, path) in spies.items():
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if pathlib.Path(path).exists():
            done[name] = pathlib.Path(path).name
    return done


def frames(path: str) -> Counter:
    """A raw py-spy file as {stack (frames outermost first, as written): samples}."""
    return frames_from(pathlib.Path(path).read_text())


def frames_from(text: str) -> Counter:
    """py-spy's raw text ("frame;frame;… count" per line) as {stack: samples}."""
    out: Counter = Counter()
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            out[stack] += int(n)
    return out


def by_function(stacks: Counter) -> tuple[Counter, Counter]:
    """(own, inclusive) samples per function ("name (file)", line numbers dropped): own = the
    innermost frame's, inclusive = every function on the stack once (recursion counted once)."""
    own, incl = Counter(), Counter()
    for stack, n in stacks.items():
        names = [_function(f) for f in stack.split(";") if f]
        if names:
            own[names[-1]] += n
            for f in set(names):
                incl[f] += n
    return own, incl


def _function(frame: str) -> str:
    """"generate (orchestrator/generation.py:253)" → "generate (orchestrator/generation.py)"."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].rstrip(')')})" if where else name


def per_round(rows: list[dict], spy_dir: pathlib.Path, c: int, config: str, service: str,
              rate: int) -> tuple[dict, dict, int]:
    """(own, inclusive) µs per round by function over the configuration's cells at c, and the
    rounds (the orchestrator's round counters of those cells). Raises ValueError when no cell of
    it has a profile of ``service`` or a round count."""
    own, incl, rounds = Counter(), Counter(), 0
    for r in rows:
        path = (r.get("py_spy") or {}).get(service)
        if r["config"] == config and r["c"] == c and path and r.get("orchestrator_rounds"):
            o, i = by_function(frames(str(spy_dir / path)))
            own, incl, rounds = own + o, incl + i, rounds + r["orchestrator_rounds"]
    if not rounds:
        raise ValueError(f"no {service} profile with a round count for {config} at c={c}")
    us = 1e6 / rate / rounds
    return {k: v * us for k, v in own.items()}, {k: v * us for k, v in incl.items()}, rounds


def compare(rows: list[dict], spy_dir: pathlib.Path, c: int, a: str, b: str, service: str = "orchestrator",
            rate: int = 200, top: int = 25) -> str:
    """A markdown table: the ``top`` functions by |B − A| own µs per round, with inclusive µs."""
    oa, ia, na = per_round(rows, spy_dir, c, a, service, rate)
    ob, ib, nb = per_round(rows, spy_dir, c, b, service, rate)
    keys = sorted(set(oa) | set(ob), key=lambda k: -abs(ob.get(k, 0.0) - oa.get(k, 0.0)))[:top]
    lines = [f"{service} at c = {c}: {a} ({na} rounds) vs {b} ({nb} rounds); CPU µs per round in Python "
             f"(samples holding the GIL at {rate} Hz): all {sum(oa.values()):.1f} vs {sum(ob.values()):.1f}", "",
             f"| function | own {a} | own {b} | own B − A | with callees {a} | with callees {b} |",
             "|---|---|---|---|---|---|"]
    for k in keys:
        lines.append(f"| `{k}` | {oa.get(k, 0.0):.2f} | {ob.get(k, 0.0):.2f} | {ob.get(k, 0.0) - oa.get(k, 0.0):+.2f} | "
                     f"{ia.get(k, 0.0):.2f} | {ib.get(k, 0.0):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a bench.concurrency json whose cells were recorded with --py-spy")
    ap.add_argument("--spy-dir", default="", help="where the profiles are (default: the run's --py-spy directory)")
    ap.add_argument("--c", type=int, required=True)
    ap.add_argument("--a", required=True, help="configuration A (e.g. tree@16)")
    ap.add_argument("--b", required=True, help="configuration B (e.g. adaptive@16)")
    ap.add_argument("--service", default="orchestrator", choices=SERVICES)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    d = json.loads(pathlib.Path(args.run).read_text())
    spy = d["meta"].get("py_spy") or {}
    spy_dir = pathlib.Path(args.spy_dir or spy.get("dir") or pathlib.Path(args.run).parent)
    md = compare(d["rows"], spy_dir, args.c, args.a, args.b, args.service, int(spy.get("rate", 200)), args.top)
    print(md, end="")
    if args.out:
        pathlib.Path(args.out).write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
