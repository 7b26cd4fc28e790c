"""Load test: N concurrent streams for a fixed time against the real three-process stack on
loopback, with mixed modes, temperatures, client cancellations and deadlines.

  python -m bench.load [--streams 32] [--duration 180] [--warmup 20] [--out bench/results/load_cpu.md]

On the lent H200 (after the GGUF parts are in place, ``scripts/device_run.sh``; the generated
gRPC code needs grpcio >= 1.85, carried in .devcarry/grpcwhl; the services find the model
through ``--gguf``, default $SPECDEC_GGUF):

  bash scripts/device_run.sh 2 bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile \\
      --upgrade --target /tmp/site .devcarry/grpcwhl/*.whl && python3 -m bench.load --streams 64 \\
      --worker-flags "--device cuda --dtype bfloat16 --graphs" --out $OUT/load_h200.md'

Bounded: no new request after ``--duration`` s (and none past ``--max-requests``); requests
still open then get ``--grace`` s, then are cancelled. Loopback only. Each request draws a
mode (autoregressive, chain, tree at budgets 4/16/64), a sampling kind (greedy, or seeded
T=0.7 / T=1.0 top-p 0.9), a prompt and max_tokens from small sets, and a behaviour: run to the
end (no deadline but a 600 s hang guard), cancel after a few chunks, or a short deadline.
Expected outcomes: OK; OK or the client's own CANCELLED; OK or DEADLINE_EXCEEDED. Anything
else counts as an unexpected error (must be 0).

Measured: per mode, requests by outcome, tokens and tokens/s; each service process's RSS
(/proc) and the workers' live requests and reserved KV rows (GetInfo) idle before (after a
warm-up phase of the same mix, so allocator caches are filled) and idle after; outputs of
speculative modes checked identical to autoregressive for the same prompt, max_tokens and
sampling (greedy, and seed-for-seed for seeded sampling), against autoregressive outputs of the
load itself or, for keys without one, autoregressive runs on the idle stack afterwards (at
most ``--check`` keys). Prints the tables and writes them (markdown) to ``--out`` with a JSON
twin next to it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import random
import shlex
import signal
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PROMPTS = ["Write a haiku about the sea.", "Explain TCP in one paragraph.", "def fibonacci(n):",
           "The capital of France is", "List three uses of a paperclip.", "Translate 'good morning' to Spanish.",
           "Once upon a time, in a small village,", "What is 17 times 23?"]
MODES = [("autoregressive", 0), ("chain", 0), ("tree", 4), ("tree", 16), ("tree", 64)]
SAMPLING = [("greedy", dict(temperature=0.0)), ("greedy", dict(temperature=0.0)), ("T0.7", dict(temperature=0.7)),
            ("T1.0/p0.9", dict(temperature=1.0, top_p=0.9))]
SEEDS = [1, 2, 3]
BEHAVIOURS = [("complete", 0.7), ("cancel", 0.15), ("deadline", 0.15)]
HANG_GUARD = 600.0


@dataclass
class Job:
    mode: str
    budget: int
    sampling: str
    params: dict
    prompt: str
    max_tokens: int
    behaviour: str
    cancel_after: int = 0    # chunks
    deadline: float = 0.0    # seconds

    @property
    def key(self) -> tuple:
        """Requests with equal keys must give identical tokens in every mode."""
        return (self.prompt, self.max_tokens, self.sampling, self.params.get("seed"))


@dataclass
class Outcome:
    job: Job
    status: str              # OK | CANCELLED (by us) | DEADLINE_EXCEEDED | other code name
    expected: bool
    tokens: list[int] = field(default_factory=list)
    finished: bool = False   # got its Final message
    seconds: float = 0.0
    details: str = ""


def draw_job(rng: random.Random, max_tokens: list[int]) -> Job:
    mode, budget = rng.choice(MODES)
    name, params = rng.choice(SAMPLING)
    params = dict(params)
    if name != "greedy":
        params["seed"] = rng.choice(SEEDS)
    behaviour = rng.choices([b for b, _ in BEHAVIOURS], [w for _, w in BEHAVIOURS])[0]
    return Job(mode, budget, name, params, rng.choice(PROMPTS), rng.choice(max_tokens), behaviour,
               cancel_after=rng.randint(1, 4), deadline=rng.uniform(0.2, 3.0))


async def run_job(stub, job: Job) -> Outcome:
    import grpc

    from specdec_client.client import build_request

    req = build_request(job.prompt, max_tokens=job.max_tokens, mode=job.mode, tree_budget=job.budget,
                        ignore_eos=True, **job.params)
    timeout = job.deadline if job.behaviour == "deadline" else HANG_GUARD
    out = Outcome(job, "OK", True)
    t0 = time.perf_counter()
    call = stub.Generate(req, timeout=timeout)
    chunks = 0
    try:
        async for r in call:
            if r.WhichOneof("event") == "delta":
                out.tokens += r.delta.token_ids
                chunks += 1
                if job.behaviour == "cancel" and chunks >= job.cancel_after:
                    call.cancel()
                    out.status = "CANCELLED"
                    break
            else:
                out.finished = True
    except asyncio.CancelledError:  # the run's grace period ended: cancel the call
        call.cancel()
        out.status, out.expected = "UNFINISHED", True
        out.details = "still running when the grace period ended (cancelled)"
    except grpc.aio.AioRpcError as e:
        out.status, out.details = e.code().name, e.details() or ""
        out.expected = job.behaviour == "deadline" and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED or (
            job.behaviour == "cancel" and e.code() == grpc.StatusCode.CANCELLED)
    out.seconds = time.perf_counter() - t0
    return out


# ---- process and worker state

def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker_state(stack) -> dict:
    import grpc

    from specdec_proto.v1 import common_pb2
    from specdec_proto.v2 import draft_pb2_grpc, target_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{stack.ports['target']}") as t, \
            grpc.insecure_channel(f"127.0.0.1:{stack.ports['draft']}") as d:
        ti = target_pb2_grpc.TargetServiceStub(t).GetInfo(common_pb2.InfoRequest(), timeout=30)
        di = draft_pb2_grpc.DraftServiceStub(d).GetInfo(common_pb2.InfoRequest(), timeout=30)
    return dict(target_live=ti.live_requests, target_kv_rows=ti.kv_reserved_tokens, kv_pool=ti.kv_pool_tokens,
                draft_live=di.live_requests, device=ti.device, dtype=ti.dtype)


def snapshot(stack) -> dict:
    return dict(rss_mb={n: round(rss_mb(p.pid), 1) for n, p in stack.procs.items()}, **worker_state(stack),
                loadavg=os.getloadavg())


def wait_idle(stack, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = worker_state(stack)
        if (s["target_live"], s["target_kv_rows"], s["draft_live"]) == (0, 0, 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.5)


# ---- the load

async def load_phase(address: str, streams: int, seconds: float, grace: float, max_requests: int,
                     rng: random.Random, max_tokens: list[int]) -> list[Outcome]:
    import grpc

    from specdec_proto.v1 import orchestrator_pb2_grpc

    outcomes: list[Outcome] = []
    started = 0
    end = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)

        async def stream_loop():
            nonlocal started
            while time.monotonic() < end and started < max_requests:
                started += 1
                outcomes.append(await run_job(stub, draw_job(rng, max_tokens)))

        tasks = [asyncio.create_task(stream_loop()) for _ in range(streams)]
        await asyncio.sleep(seconds)
        done, pending = await asyncio.wait(tasks, timeout=grace)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return outcomes


async def reference_runs(address: str, jobs: list[Job]) -> dict:
    """Autoregressive output of each job's key on the (idle) stack, one at a time."""
    import grpc

    from specdec_proto.v1 import orchestrator_pb2_grpc

    refs = {}
    async with grpc.aio.insecure_channel(address) as ch:
        stub = orchestrator_pb2_grpc.OrchestratorStub(ch)
        for job in jobs:
            ar = Job("autoregressive", 0, job.sampling, job.params, job.prompt, job.max_tokens, "complete")
            o = await run_job(stub, ar)
            if o.status == "OK" and o.finished:
                refs[job.key] = o.tokens
    return refs


def check_identity(outcomes: list[Outcome], address: str, limit: int, rng: random.Random) -> dict:
    """Compare completed speculative outputs with autoregressive ones of the same key."""
    done = [o for o in outcomes if o.status == "OK" and o.finished]
    refs = {}
    for o in done:
        if o.job.mode == "autoregressive":
            refs.setdefault(o.job.key, o.tokens)
    spec = [o for o in done if o.job.mode != "autoregressive"]
    missing = list({o.job.key: o.job for o in spec if o.job.key not in refs}.values())
    rng.shuffle(missing)
    refs.update(asyncio.run(reference_runs(address, missing[:limit])))
    checked = [o for o in spec if o.job.key in refs]
    bad = [o for o in checked if o.tokens != refs[o.job.key]]
    by_kind = Counter("greedy" if o.job.sampling == "greedy" else "seeded" for o in checked)
    return dict(checked=len(checked), greedy=by_kind["greedy"], seeded=by_kind["seeded"], mismatches=len(bad),
                keys=len({o.job.key for o in checked}), examples=[
                    dict(mode=o.job.mode, budget=o.job.budget, key=list(o.job.key)) for o in bad[:5]])


# ---- report

def summarise(outcomes: list[Outcome], seconds: float) -> list[dict]:
    rows = []
    groups = defaultdict(list)
    for o in outcomes:
        groups[(o.job.mode, o.job.budget)].append(o)
    for (mode, budget), os_ in sorted(groups.items(), key=lambda kv: MODES.index(kv[0])):
        c = Counter(o.status for o in os_)
        lat = [o.seconds for o in os_ if o.status == "OK" and o.finished]
        toks = sum(len(o.tokens) for o in os_)
        rows.append(dict(mode=f"{mode}" + (f"@{budget}" if mode == "tree" else ""), requests=len(os_),
                         ok=c["OK"], cancelled=c["CANCELLED"], deadline=c["DEADLINE_EXCEEDED"],
                         unfinished=c["UNFINISHED"],
                         unexpected=sum(not o.expected for o in os_), tokens=toks,
                         tok_s=round(toks / seconds, 1),
                         p50_s=round(statistics.median(lat), 2) if lat else None,
                         p95_s=round(sorted(lat)[int(0.95 * (len(lat) - 1))], 2) if lat else None))
    return rows


def markdown(meta: dict, rows: list[dict], before: dict, after: dict, identity: dict, errors: list[str]) -> str:
    out = [f"# Load test ({meta['streams']} streams, {meta['duration_s']} s, {meta['device']})", "",
           f"`{json.dumps(meta)}`", "",
           "| mode | requests | ok | cancelled by the client | deadline exceeded | unfinished at the end | "
           "unexpected errors | tokens | tok/s | p50 s (ok) | p95 s (ok) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    cols = ("mode", "requests", "ok", "cancelled", "deadline", "unfinished", "unexpected", "tokens", "tok_s", "p50_s",
            "p95_s")
    for r in rows:
        out.append("| " + " | ".join(str(r[k]) for k in cols) + " |")
    tot = {k: sum(r[k] for r in rows) for k in cols[1:8]}
    out.append(f"| **all** | {tot['requests']} | {tot['ok']} | {tot['cancelled']} | {tot['deadline']} | "
               f"{tot['unfinished']} | **{tot['unexpected']}** | {tot['tokens']} | "
               f"{round(tot['tokens'] / meta['duration_s'], 1)} | | |")
    out += ["", "Idle before (after the warm-up) and after the load:", "",
            "| | before | after | change |", "|---|---|---|---|"]
    for name in before["rss_mb"]:
        b, a = before["rss_mb"][name], after["rss_mb"][name]
        out.append(f"| RSS {name} (MB) | {b} | {a} | {100 * (a - b) / b:+.1f}% |")
    for k in ("target_live", "target_kv_rows", "draft_live"):
        out.append(f"| {k} | {before[k]} | {after[k]} | |")
    out.append(f"| load average (1/5/15 min) | {before['loadavg']} | {after['loadavg']} | |")
    out += ["", f"Outputs identical to autoregressive: {identity['checked'] - identity['mismatches']} of "
                f"{identity['checked']} completed speculative requests ({identity['greedy']} greedy, "
                f"{identity['seeded']} seeded; {identity['keys']} distinct prompt/max_tokens/sampling keys); "
                f"mismatches: {identity['mismatches']} {identity['examples'] or ''}"]
    if errors:
        out += ["", "Unexpected errors (first 10):", ""] + [f"- {e}" for e in errors[:10]]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load (new requests start until then)")
    ap.add_argument("--warmup", type=float, default=20.0, help="seconds of the same load before the idle snapshot")
    ap.add_argument("--grace", type=float, default=120.0, help="seconds for open requests after --duration")
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--max-tokens", default="8,16,32", help="max_tokens values drawn from")
    ap.add_argument("--check", type=int, default=16, help="max extra autoregressive reference runs afterwards")
    ap.add_argument("--worker-flags", default="", help="extra flags for both workers (e.g. on a GPU: "
                                                       "'--device cuda --dtype bfloat16 --graphs')")
    ap.add_argument("--gguf", default=os.environ.get("SPECDEC_GGUF", ""),
                    help="target GGUF for all three services (default: $SPECDEC_GGUF, else the embedded model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "load_cpu.md"))
    ap.add_argument("--log-dir", default="/tmp/specdec-load-logs")
    args = ap.parse_args(argv)

    from deploy.local import start_stack

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops the services too (finally below)
    rng = random.Random(args.seed)
    flags = shlex.split(args.worker_flags)
    env = {"SPECDEC_TARGET_MODEL": args.gguf} if args.gguf else {}
    stack = start_stack(extra={"target": flags, "draft": flags}, env=env, log_dir=args.log_dir)
    try:
        stack.wait_serving()
        t0 = time.perf_counter()
        max_tokens = [int(x) for x in args.max_tokens.split(",")]
        warm = asyncio.run(load_phase(stack.address, args.streams, args.warmup, args.grace, args.max_requests, rng,
                                      max_tokens))
        warm_idle = wait_idle(stack)
        before = snapshot(stack)
        print(f"warm-up: {len(warm)} requests in {time.perf_counter() - t0:.0f} s; idle: {before}", flush=True)
        t0 = time.perf_counter()
        outcomes = asyncio.run(load_phase(stack.address, args.streams, args.duration, args.grace,
                                          args.max_requests, rng, max_tokens))
        wall = time.perf_counter() - t0
        idle = wait_idle(stack)
        after = snapshot(stack)
        identity = check_identity(outcomes, stack.address, args.check, rng)
    finally:
        stack.stop()
    meta = dict(streams=args.streams, duration_s=args.duration, max_tokens=args.max_tokens, wall_s=round(wall, 1), warmup_s=args.warmup,
                device=f"{after['device']} {after['dtype']}", worker_flags=args.worker_flags, cpus=os.cpu_count(),
                host=platform.node(), python=platform.python_version(), seed=args.seed,
                warmup_requests=len(warm), warm_idle_ok=(warm_idle["target_live"], warm_idle["draft_live"]) == (0, 0),
                idle_after_ok=(idle["target_live"], idle["target_kv_rows"], idle["draft_live"]) == (0, 0, 0),
                rss_growth_within_5pct=all(after["rss_mb"][n] <= 1.05 * b for n, b in before["rss_mb"].items()))
    rows = summarise(outcomes, args.duration)
    errors = [f"{o.job.mode}@{o.job.budget} {o.job.sampling} {o.job.behaviour}: {o.status} {o.details}"
              for o in outcomes if not o.expected]
    text = markdown(meta, rows, before, after, identity, errors)
    print(text)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows, before=before, after=after,
                                                        identity=identity, errors=errors[:50]), indent=1))
    ok = not errors and not identity["mismatches"] and meta["idle_after_ok"] and meta["rss_growth_within_5pct"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
