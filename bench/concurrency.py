"""Throughput and latency vs concurrency (issue 14, plan 0009 "What to measure" item 5).

  python -m bench.concurrency [--configs autoregressive,chain,tree@4,tree@16,tree@64,adaptive]
      [--concurrency 1,4,16,64] [--seconds 10] [--warmup 3] [--repeat 1] [--once CONFIGS]
      [--max-tokens 128] [--temperature 0]
      [--worker-flags "--device cuda --dtype bfloat16 --graphs --max-batch 64"] [--tag h200]

Starts the real target, draft and orchestrator services once for all cells
(``deploy.local.start_stack``; worker flags passed through as in ``bench.load``, e.g.
``--max-batch``; orchestrator flags through ``--orchestrator-flags``). The adaptive rows are
tree requests of at most ``--adaptive-cap`` nodes that name ``budget_policy="adaptive"`` (the
orchestrator's planner picks each round's shape over all live requests); skipped, with a note,
where the client has no such field.

For each concurrency c and each configuration, one cell: c closed-loop client streams (each
sends a request, reads its stream to the end, sends the next) over the same bench prompts (5 HumanEval
+ 5 MT-Bench, ``bench.throughput.prompts``; stream k starts at prompt k and walks the set), a
fixed ``--max-tokens`` with ignore_eos, greedy unless ``--temperature`` (then seeded per
prompt, so every configuration samples the same output). Stream starts are spread over the
first ``--ramp`` share of the ``--warmup`` seconds (default half: the rest runs at c streams, so
the measured window is the steady state at c, where a policy that measures its own round times
has settled — as in a server whose load changes over seconds, not at the window's edge); the
warm-up is not measured; the cell then measures ``--seconds``, cancels what
is still open, and waits until the workers are idle (``bench.load.wait_idle``) before the next
cell. ``--repeat N`` measures each c's cells N times on the same stack, interleaved: the
configurations in the given order, then reversed, then as given … (``--once``: configurations
measured in the first repeat only, e.g. autoregressive), so drift of the host hits every
configuration alike and none always runs first or right after another. The client streams run
in ``ceil(c / --streams-per-client)`` processes (spawned once) so
the client's own event loop does not limit c=64. All times are ``time.monotonic`` on the host.

Per cell (window = the measured seconds):
- tok/s: completion tokens of deltas that arrived in the window ÷ the window (requests that
  started in the warm-up or were cut at the end count with their tokens inside it);
- ×AR: that ÷ the autoregressive cell's tok/s at the same c, same run;
- TTFT p50/p99 (ms): first delta − request sent, over requests sent in the window whose first
  token came before its end (a request whose first token would come later is not counted, which
  lowers p99 when TTFT nears the window);
- ITL per token p50/p99 (ms): for consecutive deltas of one request, the later one in the
  window: gap ÷ tokens in the later delta, one sample per token (a speculative round's delta
  carries several tokens, so its tokens share the gap);
- delta gap p50/p99 (ms): the raw gap between consecutive deltas (what a reader of the stream
  waits between updates);
- completed: requests whose Final came in the window; errors: any status other than our own
  cancel at the window's end (must be 0); τ: Σ completion tokens ÷ Σ rounds over completed
  requests (SpecStats); identical: completed requests whose tokens equal the autoregressive
  output of the same prompt (the AR cell at the smallest c) — batch invariance;
- mean batch: Δsum ÷ Δcount of each worker's ``*batch_size`` histogram over the cell (from
  their /metrics), when the workers export one; round shapes: the orchestrator's ``*shape*``
  counters over the cell, as shares (the adaptive planner's picks), when it exports them.

With repeats the report adds, per (configuration, c), the mean tok/s over the repeats, its
sample standard deviation and min–max, and per c adaptive ÷ the best fixed configuration (the
best by mean): the ratio of the means, the min–max of the per-repeat ratios (each repeat's
adaptive cell ÷ that configuration's cell of the same repeat) and a 90 % bootstrap interval
(repeats resampled, paired across configurations, the best re-chosen per resample); ×AR
divides by the mean of the AR cells; the json gets ``repeat_summary``, the plot means with
min–max bars.

``--py-spy DIR``: every service sampled by py-spy over every cell (``bench.spy``: the files, and
where two configurations' CPU per round differs by function).

Prints the table and writes bench/results/concurrency_<tag>.md, .json and .png (throughput, ×AR
and ITL p99 vs c), rewriting the md/json after every cell (a run cut short keeps its cells; on
SIGTERM the png too). Exit 1 when a cell had errors or left the workers busy (the services'
log tails are printed then).

H200 (from the repo root, after ``scripts/device_run.sh``: the GGUF at $SPECDEC_GGUF; grpc >=
1.85 from .devcarry/grpcwhl; the bench prompts need .devcarry/h4/eval_texts.json.gz carried).
A cell takes its warm-up + seconds + ~0.75 s (start, idle wait); start-up ~15 s. Session 8's
repeated run, 4 c × (1 AR + 3 configurations × 4 repeats) = 52 cells × 8.25 s ≈ 430 s + start-up,
`timeout` keeping it inside one call:

  bash scripts/device_run.sh 3 bash -c 'python3 -m pip install -q --no-index --no-deps --no-compile \
      --upgrade --target /tmp/site .devcarry/grpcwhl/*.whl && export SPECDEC_EVAL_TEXTS=$PWD/.devcarry/h4/eval_texts.json.gz \
      && timeout -s TERM 480 python3 -m bench.concurrency --configs autoregressive,tree@16,tree@64,adaptive \
      --once autoregressive --repeat 4 --seconds 5 --warmup 2.5 --streams-per-client 8 --tag h200 --out-dir $OUT \
      --worker-flags "--device cuda --dtype bfloat16 --graphs --max-batch 64"'
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import platform
import shlex
import shutil
import signal
import sys
import time
import urllib.request

import grpc
from dataclasses import dataclass, field

from bench import load, spy
from bench.provenance import code_identity
from bench.throughput import prompts as bench_prompts
from specdec_client.probe import check

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
CONFIGS = "autoregressive,chain,tree@4,tree@16,tree@64,adaptive"
HANG_GUARD = 600.0  # s: a request's gRPC deadline (cells cancel long before)


def parse_config(name: str, adaptive_cap: int = 64) -> tuple[str, int, str]:
    """'autoregressive' | 'chain' | 'tree@N' | 'adaptive' | 'adaptive@N' → (mode, tree_budget,
    budget_policy) of its requests (adaptive: tree of at most ``adaptive_cap`` nodes, the
    orchestrator's planner picks each round's shape; adaptive@N: at most N nodes — a diagnostic
    cell, neither adaptive nor fixed in the goals; "" = the request names no policy)."""
    if name in ("autoregressive", "chain"):
        return name, 0, ""
    if name == "adaptive":
        return "tree", adaptive_cap, "adaptive"
    if name.startswith("adaptive@") and name[9:].isdigit() and int(name[9:]) > 0:
        return "tree", int(name[9:]), "adaptive"
    if name.startswith("tree@") and name[5:].isdigit() and int(name[5:]) > 0:
        return "tree", int(name[5:]), ""
    raise ValueError(f"unknown configuration {name!r} (autoregressive, chain, tree@N, adaptive, adaptive@N)")


# ---- client side (runs in the spawned client processes)

@dataclass
class Record:
    """One request of a cell. deltas: (arrival, tokens) per TextDelta; status: OK, CUT (still
    open at the window's end: we cancelled it) or the gRPC status code name."""
    stream: int
    prompt: int
    sent: float
    deltas: list[tuple[float, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    status: str = "CUT"
    details: str = ""
    final_at: float | None = None
    completion_tokens: int = 0
    rounds: int = 0


def client_ready(_=None) -> int:
    """Imported grpc and the stubs (called once per client process when the pool starts)."""
    import grpc  # noqa: F401

    from specdec_proto.v1 import orchestrator_pb2_grpc  # noqa: F401
    time.sleep(0.5)  # keep this process busy so each ready call lands in a different one
    return os.getpid()


def client_cell(address: str, streams: list[int], c: int, prompt_set: list[dict], config: tuple[str, int, str],
                max_tokens: int, temperature: float, seed: int, start: float, ramp_s: float,
                end: float, per_stream: bool = False) -> list[Record]:
    """Run ``streams`` (global indices out of c) closed-loop from ``start`` (stream k waits
    k/c of ``ramp_s`` seconds) until ``end``, then cancel what is open. config: parse_config's
    (mode, tree_budget, budget_policy). Returns every request's Record."""
    return asyncio.run(_client_cell(address, streams, c, prompt_set, config, max_tokens, temperature, seed,
                                    start, ramp_s, end, per_stream))


async def _client_cell(address, streams, c, prompt_set, config, max_tokens, temperature, seed, start, ramp_s,
                       end, per_stream) -> list[Record]:
    import grpc

    from specdec_client.client import build_request
    from specdec_proto.v1 import orchestrator_pb2_grpc

    mode, budget, policy = config

    def request(i: int):
        kw = dict(temperature=temperature, seed=seed + i) if temperature > 0 else {}
        if policy:
            kw["budget_policy"] = policy
        return build_request(**prompt_set[i], max_tokens=max_tokens, mode=mode, tree_budget=budget, ignore_eos=True,
                             **kw)

    reqs = [request(i) for i in range(len(prompt_set))]
    records: list[Record] = []

    async def one(stub, rec: Record) -> None:
        call = stub.Generate(reqs[rec.prompt], timeout=HANG_GUARD)
        try:
            async for r in call:
                if r.WhichOneof("event") == "delta":
                    rec.deltas.append((time.monotonic(), len(r.delta.token_ids)))
                    rec.tokens += r.delta.token_ids
                else:
                    rec.final_at, rec.status = time.monotonic(), "OK"
                    rec.completion_tokens, rec.rounds = r.final.usage.completion_tokens, r.final.stats.rounds
        except asyncio.CancelledError:  # the window ended: cancel the call (status stays CUT)
            call.cancel()
            raise
        except grpc.aio.AioRpcError as e:
            rec.status, rec.details = e.code().name, e.details() or ""
            await asyncio.sleep(0.05)  # no hot loop against a failing service
        if rec.status == "CUT":  # the stream ended without a Final
            rec.status, rec.details = "NO_FINAL", "stream ended without its Final message"

    async def stream(stub, k: int) -> None:
        await asyncio.sleep(max(0.0, start + ramp_s * k / c - time.monotonic()))
        i = k
        while time.monotonic() < end:
            rec = Record(k, i % len(reqs), time.monotonic())
            records.append(rec)
            await one(stub, rec)
            i += 1

    options = [("grpc.max_receive_message_length", 64 << 20)]
    # per_stream: a connection per stream (a sharded orchestrator's kernel spreads connections, not streams)
    channels = [grpc.aio.insecure_channel(address, options=options + [("grpc.use_local_subchannel_pool", 1)])
                for _ in streams] if per_stream else [grpc.aio.insecure_channel(address, options=options)]
    try:
        stubs = [orchestrator_pb2_grpc.OrchestratorStub(ch) for ch in channels]
        tasks = [asyncio.create_task(stream(stubs[j % len(stubs)], k)) for j, k in enumerate(streams)]
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for ch in channels:
            await ch.close()
    return records


# ---- statistics of one cell

def pct(xs: list[float], q: float) -> float | None:
    """q-th percentile (linear interpolation) of xs in ms, rounded; None if empty."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return round(1000 * (xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)), 2)


def summarise(records: list[Record], t0: float, t1: float) -> dict:
    """The cell's figures over the window [t0, t1) (see the module docstring)."""
    tokens = sum(n for r in records for t, n in r.deltas if t0 <= t < t1)
    ttft = [r.deltas[0][0] - r.sent for r in records if t0 <= r.sent < t1 and r.deltas and r.deltas[0][0] < t1]
    gaps, per_token = [], []
    for r in records:
        for (a, _), (b, n) in zip(r.deltas, r.deltas[1:]):
            if t0 <= b < t1 and n > 0:
                gaps.append(b - a)
                per_token += [(b - a) / n] * n
    done = [r for r in records if r.status == "OK" and t0 <= r.final_at < t1]
    errors = [r for r in records if r.status not in ("OK", "CUT")]
    rounds = sum(r.rounds for r in done)
    return dict(tok_s=round(tokens / (t1 - t0), 2), tokens=tokens, requests=len(records),
                ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99), ttft_n=len(ttft),
                itl_p50=pct(per_token, 50), itl_p99=pct(per_token, 99),
                gap_p50=pct(gaps, 50), gap_p99=pct(gaps, 99), deltas=len(gaps),
                tokens_per_delta=round(len(per_token) / len(gaps), 2) if gaps else None,
                completed=len(done), errors=len(errors),
                error_examples=sorted({f"{r.status}: {r.details}"[:200] for r in errors})[:5],
                tau=round(sum(r.completion_tokens for r in done) / rounds, 3) if rounds else None)


# ---- /metrics of the services

def scrape(port: int | None) -> dict:
    """{(sample name, sorted labels): value} of a service's /metrics; {} when it has none."""
    if not port:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as f:
            text = f.read().decode()
    except OSError:
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric_deltas(before: dict, after: dict) -> dict:
    """Over a cell: ``mean_batch_<op>`` = Δ*batch_size_sum ÷ Δ*batch_size_count per label set
    (a worker's requests per engine call), ``shapes`` = the Δ of counters with 'shape' in
    their name as shares of their total ("tree@16 80%, one-token 20%"; label values name them)
    and ``rounds`` their Δ sum, ``cpu_s`` = Δ process_cpu_seconds_total (prometheus-client's
    process collector: the service's user + system CPU seconds, all threads)."""
    out, shapes = {}, {}
    for (name, labels), v in after.items():
        d = v - before.get((name, labels), 0.0)
        if name == "process_cpu_seconds_total":
            out["cpu_s"] = round(d, 3)
        elif "batch_size" in name and name.endswith("_count") and d > 0:
            total = name[:-len("_count")] + "_sum"
            out["mean_batch_" + "_".join(x for _, x in labels)] = round(
                (after.get((total, labels), 0.0) - before.get((total, labels), 0.0)) / d, 2)
        elif "shape" in name and not name.endswith("_created") and d > 0:
            shapes[" ".join(x for _, x in labels) or name] = d
    if shapes:
        n = sum(shapes.values())
        out["shapes"] = ", ".join(f"{k} {100 * v / n:.0f}%" for k, v in sorted(shapes.items(), key=lambda kv: -kv[1]))
        out["rounds"] = int(n)
    return out


# ---- services

def adaptive_supported() -> bool:
    """Whether the client can ask for the adaptive tree budget (``budget_policy``, helper HD's)."""
    import inspect

    from specdec_client.client import build_request

    return "budget_policy" in inspect.signature(build_request).parameters


def start_services(args, log_dir: str):
    """(stack, /metrics ports): the three services once, for every configuration (an adaptive
    request names its policy itself, so it needs no orchestrator of its own); worker flags
    from --worker-flags, orchestrator flags from --orchestrator-flags."""
    from deploy.local import free_port, start_stack

    wflags = shlex.split(args.worker_flags)
    env = {"SPECDEC_TARGET_MODEL": args.gguf} if args.gguf else {}
    metrics = {n: free_port() for n in ("target", "draft", "orchestrator")}
    extra = {n: ["--metrics-port", str(metrics[n])] for n in metrics}
    stack = start_stack(extra={"target": wflags + extra["target"], "draft": wflags + extra["draft"],
                               "orchestrator": extra["orchestrator"] + shlex.split(args.orchestrator_flags)},
                        env=env, log_dir=log_dir, data_channel=args.data_channel)
    return stack, metrics


# ---- the run

def cell_order(configs: list[str], repeat: int = 1, once: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """(repeat, configuration) in run order at one c: repeat 0 runs ``configs`` as given, each
    further repeat the order reversed from the one before (A B C, C B A, A B C, …), so no
    configuration always runs right after another or always first; ``once``: configurations run
    in repeat 0 only (e.g. autoregressive: ×AR needs it, the adaptive ÷ best-fixed question not)."""
    out = []
    for rep in range(repeat):
        names = [n for n in (configs if rep % 2 == 0 else configs[::-1]) if rep == 0 or n not in once]
        out += [(rep, n) for n in names]
    return out


def run_cells(args, configs: list[str], stack, metrics: dict, log=print, rows: list | None = None,
              on_cell=None) -> list[dict]:
    """Every (c, configuration) cell in order: c ascending, at each c ``cell_order`` (``configs``
    as given, ``args.repeat`` times interleaved, ``args.once`` in the first only), against
    running services: ``stack.address`` the orchestrator, ``stack.ports`` the target and draft
    (idle checks), ``metrics`` the /metrics ports of "target", "draft", "orchestrator" (any may
    be missing). Returns one row per cell: summarise's figures, idle_after, metric deltas,
    x_ar and identical (``add_ratios_and_identity``). Rows are appended to ``rows`` as cells end
    (with their ``_outputs``; ``on_cell(rows)`` then), so a caller keeps the finished cells of
    an interrupted run."""
    import multiprocessing

    cs = [int(x) for x in args.concurrency.split(",")]
    ps = bench_prompts(args.prompts)
    nproc = math.ceil(max(cs) / args.streams_per_client)
    rows = [] if rows is None else rows
    with multiprocessing.get_context("spawn").Pool(nproc) as pool:
        pool.map(client_ready, range(nproc))
        for c in cs:
            for rep, name in cell_order(configs, getattr(args, "repeat", 1), tuple(getattr(args, "once", ()))):
                before = {n: scrape(metrics.get(n)) for n in ("target", "draft", "orchestrator")}
                spies = None
                if getattr(args, "py_spy", ""):  # each service's stacks between the scrapes (bench.spy)
                    spies = spy.start({n: p.pid for n, p in stack.procs.items()}, args.py_spy,
                                      spy.cell_stem(c, name, rep), args.py_spy_rate)
                scraped = time.monotonic()
                start = scraped + 0.5
                t0, t1 = start + args.warmup, start + args.warmup + args.seconds
                chunks = [list(range(c))[i::math.ceil(c / args.streams_per_client)]
                          for i in range(math.ceil(c / args.streams_per_client))]
                jobs = [pool.apply_async(client_cell, (stack.address, ks, c, ps, parse_config(name, args.adaptive_cap),
                                                       args.max_tokens, args.temperature, args.seed, start,
                                                       args.ramp * args.warmup, t1,
                                                       getattr(args, "channel_per_stream", False)))
                        for ks in chunks]
                records = [r for j in jobs for r in j.get(timeout=args.warmup + args.seconds + 120)]
                idle = load.wait_idle(stack, timeout=30.0)
                after = {n: scrape(metrics.get(n)) for n in ("target", "draft", "orchestrator")}
                wall = time.monotonic() - scraped
                if spies:
                    spies = spy.finish(spies)
                row = dict(config=name, c=c, rep=rep, **summarise(records, t0, t1),
                           idle_after=(idle["target_live"], idle["target_kv_rows"], idle["draft_live"]) == (0, 0, 0))
                for n in ("target", "draft", "orchestrator"):
                    row.update({f"{n}_{k}": v for k, v in metric_deltas(before[n], after[n]).items()})
                    if f"{n}_cpu_s" in row:  # the share of one core the service used between the scrapes
                        row[f"{n}_cpu"] = round(row[f"{n}_cpu_s"] / wall, 2)
                if row.get("orchestrator_rounds"):
                    row["orchestrator_cpu_us_round"] = round(1e6 * row["orchestrator_cpu_s"] / row["orchestrator_rounds"], 1)
                if spies:
                    row["py_spy"] = spies
                row["_outputs"] = [(r.prompt, r.tokens) for r in records if r.status == "OK" and t0 <= r.final_at < t1]
                rows.append(row)
                if on_cell:
                    on_cell(rows)
                log(f"c={c} {name}{f' (repeat {rep})' if rep else ''}: {row['tok_s']} tok/s, {row['completed']} "
                    f"completed, {row['errors']} errors, ITL p99 {row['itl_p99']} ms, TTFT p99 {row['ttft_p99']} ms",
                    flush=True)
    return finished(rows)


def finished(rows: list[dict]) -> list[dict]:
    """Copies of run_cells' rows with x_ar and identical, without ``_outputs``."""
    rows = [dict(r) for r in rows]
    add_ratios_and_identity(rows)
    return rows


def add_ratios_and_identity(rows: list[dict]) -> None:
    """×AR at the same c (÷ the mean of its autoregressive cells), and identical = completed
    outputs equal to the AR output of the same
    prompt (the AR cell at the smallest c that completed that prompt). Drops ``_outputs``."""
    ar = {c: mean([r["tok_s"] for r in rows if r["config"] == "autoregressive" and r["c"] == c])
          for c in {r["c"] for r in rows if r["config"] == "autoregressive"}}  # (repeats: their mean)
    ref = {}
    for r in sorted((r for r in rows if r["config"] == "autoregressive"), key=lambda r: r["c"]):
        for p, toks in r["_outputs"]:
            ref.setdefault(p, toks)
    for r in rows:
        r["x_ar"] = round(r["tok_s"] / ar[r["c"]], 3) if ar.get(r["c"]) else None
        checked = [(p, t) for p, t in r.pop("_outputs") if p in ref]
        r["identical"] = f"{sum(t == ref[p] for p, t in checked)}/{len(checked)}"


# ---- report

COLUMNS = [("config", "config"), ("c", "c"), ("tok_s", "tok/s"), ("x_ar", "×AR"), ("ttft_p50", "TTFT p50"),
           ("ttft_p99", "TTFT p99"), ("itl_p50", "ITL/token p50"), ("itl_p99", "ITL/token p99"),
           ("gap_p50", "delta gap p50"), ("gap_p99", "delta gap p99"), ("tokens_per_delta", "tokens/delta"),
           ("completed", "completed"), ("errors", "errors"), ("tau", "τ"), ("identical", "identical to AR"),
           ("target_mean_batch_verify", "mean batch verify"), ("draft_mean_batch_draft", "mean batch draft"),
           ("orchestrator_shapes", "round shapes"), ("orchestrator_cpu", "orchestrator cores"),
           ("orchestrator_cpu_us_round", "orchestrator CPU µs/round"), ("target_cpu", "target cores"),
           ("draft_cpu", "draft cores")]


def markdown(meta: dict, rows: list[dict], notes: list[str]) -> str:
    out = [f"# Throughput and latency vs concurrency ({meta['tag']}, {meta['device']})", ""]
    out += [meta["note"], ""] if meta.get("note") else []
    out += [f"`{json.dumps(meta)}`", "",
           "Times in ms. tok/s: completion tokens whose delta arrived in the measured window ÷ its "
           "seconds. ×AR: ÷ autoregressive at the same c. TTFT: first delta − request sent. ITL/token: "
           "gap between a request's consecutive deltas ÷ tokens in the later delta, one sample per token; "
           "delta gap: the raw gap. completed: Finals in the window; errors: any status but our cancel at "
           "the window's end. τ: tokens ÷ rounds of completed requests. identical to AR: completed outputs "
           "equal to the autoregressive output of the same prompt. mean batch: requests per engine call "
           "(the workers' batch-size histograms over the cell); round shapes: the orchestrator's shape "
           "counters over the cell (empty where not exported). cores: a service's CPU seconds ÷ wall "
           "seconds from before the cell's warm-up to after its drain (prometheus-client's process "
           "collector); orchestrator CPU µs/round: its CPU seconds ÷ its rounds over the same span.", ""]
    cols = COLUMNS[:2] + [("rep", "repeat")] + COLUMNS[2:] if repeated(rows) else COLUMNS
    out += ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join("" if r.get(k) is None else str(r.get(k)) for k, _ in cols) + " |")
    out += repeats_table(rows) + goals(rows)
    errs = [f"- {r['config']} c={r['c']}: {e}" for r in rows for e in r["error_examples"]]
    if notes or errs:
        out += [""] + [f"- {n}" for n in notes] + errs
    return "\n".join(out) + "\n"


def mean(xs) -> float:
    return sum(xs) / len(xs)


def repeated(rows: list[dict]) -> bool:
    """Whether any cell was measured more than once (``--repeat``)."""
    return any(r.get("rep", 0) for r in rows)


def by_cell(rows: list[dict]) -> dict:
    """{(config, c): {repeat: tok/s}} in run order (a single run: repeat 0 only)."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["config"], r["c"]), {})[r.get("rep", 0)] = r["tok_s"]
    return out


def shape_share(text: str, shape: str) -> float | None:
    """The share (0…1) of ``shape`` ("tree@64") in a ``round shapes`` cell ("tree@64 96%, tree@16
    4%"); None for an empty cell. A configuration named without a size ("chain") matches its
    sized shapes ("chain@7": the orchestrator names a chain round by its length)."""
    parts = [p.rsplit(" ", 1) for p in filter(None, (x.strip() for x in text.split(",")))]
    if not parts:
        return None
    return sum(float(v.rstrip("%")) for k, v in parts
               if k == shape or ("@" not in shape and k.startswith(shape + "@"))) / 100


RULE_RATIO = 0.97  # plans/0009 "Session 25": adaptive ÷ best fixed, ratio of means, at least this (and the interval reaching 1)


def repeat_summary(rows: list[dict], resamples: int = 2000, seed: int = 0) -> list[dict]:
    """Per c with an adaptive cell: the adaptive mean tok/s over its repeats, the best fixed
    configuration (tree or chain; not autoregressive, not adaptive) by mean tok/s, ``ratio`` =
    the ratio of the means, ``rep_ratios`` = adaptive ÷ that configuration within each repeat
    where it ran above 0 tok/s (the same repeat: cells run back to back), and ``ci90`` = a 90 %
    bootstrap interval of the ratio of means — repeats resampled with replacement, the same draw
    for every configuration (paired), the best fixed re-chosen in each resample (None with fewer
    than 3 common repeats); ``median_ratio`` = the ratio of the medians (None where the best's is
    0; a cell slowed by the host — a busy lease hits one configuration's cell at a time — moves a
    mean, hardly a median) and ``same_shape`` = the mean
    share of adaptive's rounds in the best fixed configuration's shape (its ``round shapes``
    column; None where the orchestrator exported none): near 1, adaptive ran that configuration;
    ``rule`` = issue 14's last clause under the rule plans/0009 "Session 25" fixed before its runs —
    "holds" where the ratio of means is ≥ ``RULE_RATIO`` and the bootstrap interval reaches 1,
    "fails" otherwise, None without an interval."""
    import random
    import statistics

    cells, out = by_cell(rows), []
    for c in dict.fromkeys(r["c"] for r in rows):
        ad = cells.get(("adaptive", c))
        fixed = {n: v for (n, cc), v in cells.items() if cc == c and n != "autoregressive" and not n.startswith("adaptive")}
        if not ad or not fixed:
            continue
        best = max(fixed, key=lambda n: mean(list(fixed[n].values())))
        b = fixed[best]
        common = sorted(set(ad).intersection(*[set(v) for v in fixed.values()]))
        ci = None
        if len(common) >= 3:
            rng, draws = random.Random(seed), []
            for _ in range(resamples):
                pick = [rng.choice(common) for _ in common]
                draws.append(mean([ad[k] for k in pick]) / max(mean([v[k] for k in pick]) for v in fixed.values()))
            draws.sort()
            ci = (round(draws[int(0.05 * resamples)], 4), round(draws[int(0.95 * resamples) - 1], 4))
        shares = [shape_share(r.get("orchestrator_shapes", ""), best) for r in rows
                  if r["config"] == "adaptive" and r["c"] == c]
        shares = [x for x in shares if x is not None]
        out.append(dict(c=c, adaptive=round(mean(list(ad.values())), 1), n=len(ad), best=best,
                        best_tok_s=round(mean(list(b.values())), 1),
                        ratio=round(mean(list(ad.values())) / mean(list(b.values())), 4),
                        median_ratio=(round(statistics.median(ad.values()) / statistics.median(b.values()), 4)
                                      if statistics.median(b.values()) else None),
                        same_shape=round(mean(shares), 3) if shares else None,
                        rep_ratios=[round(ad[k] / b[k], 4) for k in sorted(ad) if b.get(k)], ci90=ci))
        ratio = out[-1]["ratio"]
        out[-1]["rule"] = None if ci is None else ("holds" if ratio >= RULE_RATIO and ci[1] >= 1.0 else "fails")
    return out


def repeats_table(rows: list[dict]) -> list[str]:
    """Per (configuration, c): repeats, mean tok/s, sample standard deviation (and as % of the
    mean), min–max and each repeat's figure in run order; [] for a single run."""
    if not repeated(rows):
        return []
    out = ["", "Repeated cells (interleaved at each c, same stack): tok/s over the repeats.", "",
           "| config | c | repeats | mean | sd | sd % | min–max | per repeat |", "|---|---|---|---|---|---|---|---|"]
    for (name, c), v in by_cell(rows).items():
        xs = list(v.values())
        m = mean(xs)
        sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
        out.append(f"| {name} | {c} | {len(xs)} | {m:.1f} | {'' if sd is None else f'{sd:.1f}'} | "
                   f"{'' if sd is None else f'{100 * sd / m:.1f}'} | {min(xs):.1f}–{max(xs):.1f} | "
                   + " ".join(f"{x:.0f}" for x in xs) + " |")
    return out


def goals(rows: list[dict]) -> list[str]:
    """Issue 14's goals per c, as lines: adaptive ÷ AR (≥ 1.3 at c=16, ≥ 1.0 at c=64) and
    adaptive ÷ the best fixed configuration (≥ 1 at every c); [] without adaptive rows. With
    repeats: means over the repeats, the best fixed by mean, the per-repeat ratios' min–max and
    a bootstrap 90 % interval of the ratio of means (``repeat_summary``)."""
    cells = by_cell(rows)
    ar = {c: mean(list(v.values())) for (n, c), v in cells.items() if n == "autoregressive"}
    summary = {s["c"]: s for s in repeat_summary(rows)}
    out = []
    for (name, c), v in cells.items():
        if name != "adaptive":
            continue
        m = mean(list(v.values()))
        x_ar = round(m / ar[c], 3) if ar.get(c) else None
        s = summary.get(c)
        if s is None or not s["best_tok_s"]:
            vs_best = "no fixed row"
        elif not repeated(rows):
            vs_best = f"{m / s['best_tok_s']:.3f} × the best fixed ({s['best']}, {s['best_tok_s']} tok/s)"
        else:
            vs_best = (f"{s['ratio']:.3f} × the best fixed ({s['best']}, mean {s['best_tok_s']} tok/s)"
                       + (f"; per repeat {min(s['rep_ratios']):.3f}–{max(s['rep_ratios']):.3f}" if s["rep_ratios"] else "")
                       + (f"; bootstrap 90 % {s['ci90'][0]:.3f}–{s['ci90'][1]:.3f}" if s["ci90"] else "")
                       + ("" if s["median_ratio"] is None else f"; ratio of medians {s['median_ratio']:.3f}")
                       + ("" if s["same_shape"] is None else f"; {100 * s['same_shape']:.0f} % of adaptive's rounds in "
                          f"{s['best']}'s shape")
                       + ("" if s["rule"] is None else f"; the rule of plans/0009 session 25: {s['rule']}"))
        out.append(f"| {c} | {round(m, 1) if repeated(rows) else m} | {x_ar} | {vs_best} |")
    if not out:
        return []
    head = "| c | adaptive tok/s | ×AR | vs best fixed |"
    if repeated(rows):
        head = "| c | adaptive tok/s (mean) | ×AR (means) | vs best fixed (ratio of means) |"
    return ["", "Goals (issue 14): adaptive ≥ 1.3× AR at c=16, ≥ 1.0× at c=64, ≥ the best fixed budget at every c.",
            "", head, "|---|---|---|---|"] + out


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]
        cs = list(dict.fromkeys(r["c"] for r in rs))
        for ax, key in zip(axes, ("tok_s", "x_ar", "itl_p99")):
            per_c = [[r[key] for r in rs if r["c"] == c and r.get(key) is not None] for c in cs]
            if not any(per_c):
                continue
            ys = [mean(v) if v else math.nan for v in per_c]  # repeats: the mean, min–max as error bars
            lo = [y - min(v) if v else 0.0 for y, v in zip(ys, per_c)]
            hi = [max(v) - y if v else 0.0 for y, v in zip(ys, per_c)]
            ax.errorbar(cs, ys, yerr=[lo, hi] if any(lo) or any(hi) else None, marker="o", capsize=3, label=name)
    ticks = sorted({r["c"] for r in rows})
    for ax, label in zip(axes, ("throughput (completion tok/s)", "throughput ÷ autoregressive, same c",
                                "ITL per token p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.set_xlabel("concurrency (closed-loop streams)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(meta: dict, rows: list[dict], notes: list[str], out_dir: pathlib.Path, tag: str, png: bool = True) -> str:
    """concurrency_<tag>.md, .json and (png) .png in out_dir; returns the markdown."""
    text = markdown(meta, rows, notes)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"concurrency_{tag}.md").write_text(text)
    data = dict(meta=meta, rows=rows, notes=notes)
    if repeated(rows):
        data["repeat_summary"] = repeat_summary(rows)
    (out_dir / f"concurrency_{tag}.json").write_text(json.dumps(data, indent=1))
    if png and rows:
        plot(rows, out_dir / f"concurrency_{tag}.png", f"bench.concurrency ({meta['device']}, max_tokens "
                                                      f"{meta['max_tokens']}, T={meta['temperature']})")
    return text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.concurrency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=CONFIGS, help="comma-separated: autoregressive, chain, tree@N, adaptive")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated closed-loop stream counts")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per cell")
    ap.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds per cell (stream starts spread)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each c's cells this many times, interleaved (the order reversed every repeat), "
                         "on the same stack; the report adds means, spreads and adaptive ÷ best fixed per repeat")
    ap.add_argument("--once", default="", help="comma-separated configurations measured in the first repeat only "
                                               "(e.g. autoregressive: ×AR divides by its mean)")
    ap.add_argument("--ramp", type=float, default=0.5,
                    help="share of the warm-up over which the c streams start (1: all of it, as before session 7)")
    ap.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request (ignore_eos)")
    ap.add_argument("--prompts", type=int, default=10, help="bench prompts (half HumanEval, half MT-Bench)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled, seed per prompt")
    ap.add_argument("--seed", type=int, default=1, help="prompt i's sampling seed is seed + i")
    ap.add_argument("--worker-flags", default="", help="extra flags for both workers (GPU: '--device cuda --dtype "
                                                       "bfloat16 --graphs'; batching: '--max-batch N')")
    ap.add_argument("--adaptive-cap", type=int, default=64, help="tree budget cap of adaptive requests")
    ap.add_argument("--orchestrator-flags", default="", help="extra orchestrator flags (e.g. '--cost-model F')")
    ap.add_argument("--data-channel", action=argparse.BooleanOptionalAction, default=True,
                    help="the workers' Session streams over their Unix-socket data channel, as deploy.local "
                         "runs them (--no-data-channel: over gRPC)")
    ap.add_argument("--gguf", default=os.environ.get("SPECDEC_GGUF", ""),
                    help="target GGUF for all services (default: $SPECDEC_GGUF, else the embedded model)")
    ap.add_argument("--streams-per-client", type=int, default=16, help="client streams per client process")
    ap.add_argument("--channel-per-stream", action=argparse.BooleanOptionalAction, default=False,
                    help="a connection per client stream (for '--orchestrator-flags \"--processes N\"': the kernel "
                         "spreads connections over the shards; default: one per client process)")
    ap.add_argument("--from-json", default="", help="only rewrite the md and png of a run's json (in --out-dir, "
                                                    "its tag); starts nothing")
    ap.add_argument("--note", default="", help="a line of context for the report (host, what else ran, code)")
    ap.add_argument("--tag", default="", help="results name: concurrency_<tag>.* (default: cpu or gpu)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--log-dir", default="/tmp/specdec-concurrency-logs")
    ap.add_argument("--py-spy", default="", metavar="DIR",
                    help="record each service with py-spy over every cell's measured window into DIR (bench.spy "
                         "compares two configurations; needs py-spy on PATH)")
    ap.add_argument("--py-spy-rate", type=int, default=200, help="py-spy samples per second")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.from_json:
        d = json.loads(pathlib.Path(args.from_json).read_text())
        print(write(d["meta"], d["rows"], d["notes"], pathlib.Path(args.out_dir), d["meta"]["tag"]))
        return 0
    configs = args.configs.split(",")
    for name in configs:
        parse_config(name)
    args.once = [n for n in args.once.split(",") if n]
    if args.repeat < 1 or not set(args.once) <= set(configs):
        raise SystemExit("--repeat must be >= 1 and --once name configurations of --configs")
    notes = []
    if any(n.startswith("adaptive") for n in configs) and not adaptive_supported():
        configs = [n for n in configs if not n.startswith("adaptive")]
        notes.append("adaptive skipped: the client has no budget_policy at this commit (the adaptive tree budget, "
                     "helper HD's, had not landed)")
    if args.py_spy:
        if shutil.which("py-spy") is None:
            raise SystemExit("--py-spy needs the py-spy binary on PATH (pip install py-spy)")
        os.makedirs(args.py_spy, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops the services too (finally below)
    t_start = time.perf_counter()
    stack, metrics = start_services(args, args.log_dir)
    rows, meta = [], None

    def report(rows: list[dict], png: bool = False) -> str:
        meta["wall_s"], meta["cells"] = round(time.perf_counter() - t_start, 1), len(rows)
        meta["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        return write(meta, finished(rows), notes, pathlib.Path(args.out_dir), meta["tag"], png)

    try:
        stack.wait_serving()
        settled = 0  # every shard of a sharded orchestrator ready: SERVING on 16 fresh connections in a row
        for _ in range(600):
            settled = settled + 1 if check(stack.address, "specdec.v1.Orchestrator") == "SERVING" else 0
            if settled == 16:
                break
            time.sleep(0.05)
        for attempt in range(240):  # the orchestrator serves once the target is up; the drafter may still load
            try:
                state = load.worker_state(stack)
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == 239:
                    raise
                time.sleep(0.5)
        print(f"serving after {time.perf_counter() - t_start:.0f} s: {state['device']} {state['dtype']}", flush=True)
        for n in notes:
            print(n, flush=True)
        meta = dict(tag=args.tag or ("cpu" if state["device"].startswith("cpu") else "gpu"),
                    device=f"{state['device']} {state['dtype']}", note=args.note, worker_flags=args.worker_flags,
                    orchestrator_flags=args.orchestrator_flags, data_channel=args.data_channel,
                    configs=",".join(configs),
                    concurrency=args.concurrency, seconds=args.seconds, warmup=args.warmup, ramp=args.ramp,
                    repeat=args.repeat, once=",".join(args.once), busy_poll=busy_poll(),
                    max_tokens=args.max_tokens, prompts=args.prompts, temperature=args.temperature,
                    adaptive_cap=args.adaptive_cap, streams_per_client=args.streams_per_client,
                    channel_per_stream=args.channel_per_stream,
                    **({"py_spy": dict(dir=args.py_spy, rate=args.py_spy_rate)} if args.py_spy else {}),
                    startup_s=round(time.perf_counter() - t_start, 1), cpus=os.cpu_count(),
                    python=platform.python_version(), **code_identity(),
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        run_cells(args, configs, stack, metrics, rows=rows, on_cell=report)
    finally:
        stack.stop()
        if meta is not None:  # also after an interruption: the cells that ended
            text = report(rows, png=True)
        if not rows or any(r["errors"] or not r["idle_after"] for r in rows):
            log_tails(args.log_dir)
    print(text)
    return 0 if all(r["errors"] == 0 and r["idle_after"] for r in rows) else 1


def busy_poll() -> str:
    """The data channel's busy-polling as the services on this host resolve it (``SPECDEC_SPIN_US``,
    unset = auto: on with >= 8 usable CPUs, only while <= ``SPECDEC_SPIN_MAX_LIVE`` requests are live)."""
    try:
        from serving.datachannel import spin_settings

        seconds, live = spin_settings()
    except (ImportError, ValueError) as e:
        return f"unknown ({type(e).__name__})"
    source = os.environ.get("SPECDEC_SPIN_US", "").strip() or "auto"
    return f"{round(seconds * 1e6)} us while <= {live} live ({source})" if seconds else f"off ({source})"


def log_tails(log_dir: str, lines: int = 15) -> None:
    """Print the last lines of each service log (a failed run's first clue)."""
    for path in sorted(pathlib.Path(log_dir).glob("*.log")):
        print(f"--- {path.name} (last {lines} lines)", *path.read_text(errors="replace").splitlines()[-lines:],
              sep="\n", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
