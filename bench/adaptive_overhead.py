"""The adaptive budget's own orchestrator CPU: what an adaptive request costs the one
orchestrator process per round beyond a fixed tree@16 request (issue 14 item 3; the H200
c=64 gap of bench/results/concurrency_h200_c64.md).

  python -m bench.adaptive_overhead planner [--rounds 20000] [--profile]
  python -m bench.adaptive_overhead loop [--rounds 20000] [--profile]
  python -m bench.adaptive_overhead services [--concurrency 16,64] [--seconds 40] [--max-tokens 24]

``planner`` (in process, pure Python): the ``BudgetPlanner`` calls a request makes in
``generation.generate`` — ``join`` at its start, ``next_shape`` and ``observe`` every round,
``leave`` at its end — in a closed loop of c requests of ``--rounds-per-request`` rounds
(43: 128 tokens at τ 3) whose rounds arrive at the measured H200 through-services rate
(``bench.budget_sim.ROUNDS_PER_S``) on a simulated clock, so re-plans come as often per round
as there. Per cell: CPU µs per round of all planner calls (``time.process_time``, plans
included), plans per simulated second; and one re-plan alone at c tickets (with measured round
times, so the online correction's work is in it). ``--profile``: cProfile of the adaptive c=64 cell.

``loop``: the orchestrator's whole round loop (``generation.generate``: planner, draft link,
acceptance walk, feature tail, detokenising output stream with the real tokenizer) for c
closed-loop requests of 128 tokens on one event loop, against in-process stand-in clients
that answer at once (a drafter returning a binary tree of the round's budget, a target whose
samples accept two drafts and whose edge probabilities give the reference acceptance; feature
rows as wire ``Tensor`` messages; stream k's first request has 128·(k+1)/c tokens, so that joins
spread out as in a closed loop of staggered streams): process CPU µs per round, tree@16 vs adaptive (cap 64) on
the H200 cost model. gRPC and the wire are not in it — they cost the same per round for both
policies; the stand-ins' own work is in it, equally for both. ``--profile``: cProfile of the
adaptive c=64 cell.

``services``: the real target, draft and orchestrator (``bench.concurrency``'s stack, CPU
workers unless ``--worker-flags`` say otherwise) and c closed-loop streams per cell
(tree@16 and adaptive); the orchestrator process's CPU seconds (user + system, from
/proc/<pid>/stat) over the cell ÷ the rounds it ran (Δ ``specdec:round_shape_total``), and net
of its idle CPU (pings, health checks; measured for ``--idle`` s first). The CPU
workers are slow (seconds per round at c=64), so the orchestrator is mostly idle there and
wall-clock-driven work (re-plans at most every ``min_interval``) is rare per round: this part
measures the per-round code path, the ``planner`` part the re-plan load at the H200's rate.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import random
import signal
import sys
import time

from bench.budget_sim import ROUNDS_PER_S
from modeling import acceptance
from orchestrator.adaptive import BudgetPlanner
from orchestrator.budget import H200_BENCH_ACCEPTED, H200_COSTS
from protocol.types import Mode


def planner_cell(c: int, adaptive: bool, rounds: int, per_request: int = 43, seed: int = 0) -> dict:
    """CPU µs per round of the planner calls of c closed-loop requests (see the module docstring)."""
    rng, now = random.Random(seed), [0.0]
    p = BudgetPlanner(H200_COSTS, clock=lambda: now[0])
    budget = 64 if adaptive else 16
    live = [[p.join(Mode.TREE, budget, adaptive), rng.randrange(per_request)] for _ in range(c)]
    levels = [(1.3, 0.75)[i % 2] for i in range(c)]
    dt, plans0, joins = 1 / ROUNDS_PER_S[c], p.plans, 0
    cpu0 = time.process_time()
    for i in range(rounds):
        k = i % c
        t, left = live[k]
        s = p.next_shape(t)
        accepted = 0.0
        if s.drafts:
            mean = min(levels[k] * H200_BENCH_ACCEPTED.get(s, 2.0), s.nodes)
            accepted = float(min(int(rng.expovariate(1 / mean) + 0.5), s.nodes))
        p.observe(t, s, accepted if s.drafts else None)
        if left <= 1:  # the request ends; the stream's next request joins
            p.leave(t)
            live[k] = [p.join(Mode.TREE, budget, adaptive), per_request]
            joins += 1
        else:
            live[k][1] = left - 1
        now[0] += dt
    cpu = time.process_time() - cpu0
    return dict(us_per_round=1e6 * cpu / rounds, plans_per_s=(p.plans - plans0) / (rounds * dt),
                joins_per_s=joins / (rounds * dt), plans_per_round=(p.plans - plans0) / rounds)


def plan_call_ms(c: int, repeat: int = 20) -> float:
    """ms of one re-plan of a planner with c adaptive (cap 64) tickets whose round times are
    measured at two shapes (the online correction's work included)."""
    now = [0.0]
    p = BudgetPlanner(H200_COSTS, clock=lambda: now[0], min_interval=0.0, max_plan_share=float("inf"))
    ts = [p.join(Mode.TREE, 64, True) for _ in range(c)]
    for k in range(2 * p.min_steps + p.min_rounds // c + 2):  # measure the model's pick, then a probe
        for t in ts:
            s = p.next_shape(t)
            p.observe(t, s, 2.0 if s.drafts else None)
        now[0] += 0.03
    t0 = time.process_time()
    for _ in range(repeat):
        p._replan(now[0])
    return 1000 * (time.process_time() - t0) / repeat
def run_planner(args) -> None:
    print(f"planner calls per round, H200 round rates {ROUNDS_PER_S}, {args.rounds} rounds per cell, "
          f"{args.rounds_per_request} rounds per request")
    print("| c | policy | CPU µs/round | plans/s | plans/round | joins/s | ms per re-plan |")
    print("|---|---|---|---|---|---|---|")
    for c in [int(x) for x in args.concurrency.split(",")]:
        ms = plan_call_ms(c)
        for adaptive in (False, True):
            r = planner_cell(c, adaptive, args.rounds, args.rounds_per_request)
            print(f"| {c} | {'adaptive' if adaptive else 'tree@16'} | {r['us_per_round']:.1f} | {r['plans_per_s']:.1f} "
                  f"| {r['plans_per_round']:.4f} | {r['joins_per_s']:.0f} | {ms:.3f} |", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        planner_cell(64, True, args.rounds, args.rounds_per_request)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        print(s.getvalue())


class StandInTarget:
    """Answers at once: the first token, then per verify samples that accept the root's first
    child and its first child (two drafts, then the bonus), edge probabilities 0.4."""

    def __init__(self, vocab: list[int], width: int = 64):
        self.vocab, self.width = vocab, width
        self.held: dict[str, int] = {}  # rows of held verifies per request (returned by the next one that does not hold)

    def _features(self, n: int):
        from specdec_proto.v1 import common_pb2

        return common_pb2.Tensor(dtype="bfloat16", shape=[n, self.width], data=bytes(2 * n * self.width))

    async def prefill(self, request_id, prompt, max_new_tokens, sampling, mode, tree_budget, timeout=None,
                      hold: bool = False):
        from protocol.types import Prefilled

        await asyncio.sleep(0)
        first = self.vocab[len(prompt) % len(self.vocab)]
        if hold:
            self.held[request_id] = len(prompt)
            return Prefilled(first, None)
        return Prefilled(first, self._features(len(prompt)))

    async def verify(self, request_id, tokens, parents, commit, hold: bool = False):
        from protocol.types import Verified

        await asyncio.sleep(0)
        n, samples = len(tokens), [self.vocab[(t * 7 + 3) % len(self.vocab)] for t in tokens]
        child = {}
        for i in range(1, n):
            child.setdefault(parents[i], i)
        path, v = [0], 0
        while len(path) < 3 and v in child:
            samples[v] = tokens[child[v]]
            v = child[v]
            path.append(v)
        path, _ = acceptance.resolve(tokens, parents, samples)  # (a later sample may match a child's token too)
        if hold:
            self.held[request_id] = self.held.get(request_id, 0) + len(path)
            return Verified(samples, [1.0] + [0.4] * (n - 1), path, None)
        held = self.held.pop(request_id, 0)
        return Verified(samples, [1.0] + [0.4] * (n - 1), path, self._features(held + len(path)), held)

    async def release(self, request_id, abort=False):
        await asyncio.sleep(0)


class StandInDraft:
    """Answers at once with a binary tree (node i's parent (i - 1) // 2) of the round's budget."""

    block_size, max_context = 8, 1 << 20

    def __init__(self, vocab: list[int]):
        self.vocab = vocab

    async def draft(self, request_id, features, context_start, bonus, mode, tree_budget, timeout=None,
                    round_budget=None):
        await asyncio.sleep(0)
        n, k = round_budget or tree_budget, context_start + bonus
        return ([bonus] + [self.vocab[(k + i) % len(self.vocab)] for i in range(1, n + 1)],
                [-1] + [(i - 1) // 2 for i in range(1, n + 1)])

    async def release(self, request_id, abort=False):
        await asyncio.sleep(0)


async def _loop_cell(c: int, adaptive: bool, rounds: int, tokenizer, vocab: list[int], fixed: int = 16,
                     learn: bool = True) -> dict:
    from orchestrator.fallback import DraftHealth
    from orchestrator.generation import GenerationRequest, generate

    planner, health = BudgetPlanner(H200_COSTS, defer=True, learn=learn), DraftHealth()
    target, draft = StandInTarget(vocab), StandInDraft(vocab)
    prompt = tokenizer.encode("Write a Python function that returns the n-th Fibonacci number, with a docstring.")
    done = [0]

    async def stream(k: int) -> None:
        i = 0
        while done[0] < rounds:
            n = 128 if i else 128 * (k + 1) // c  # first requests of different lengths: joins spread out
            req = GenerationRequest(f"s{k}.{i}", prompt, n, mode=Mode.TREE, tree_budget=64 if adaptive else fixed,
                                    budget_policy="adaptive" if adaptive else "fixed")
            async for ev in generate(req, tokenizer, target, draft, health, planner):
                if hasattr(ev, "stats"):
                    done[0] += ev.stats.rounds
            i += 1

    t0, cpu0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(stream(k) for k in range(c)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    return dict(us_per_round=1e6 * cpu / done[0], rounds=done[0], rounds_per_s=done[0] / wall,
                plans=planner.plans, shapes=planner.last.shapes[:1] if planner.last else ())


def run_loop(args) -> None:
    from modeling.tokenizer import TextTokenizer
    from modeling.weights import default_gguf_path

    tokenizer = TextTokenizer.from_file(default_gguf_path())
    vocab = tokenizer.encode(" def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2) # the n-th number")
    print(f"orchestrator round loop with stand-in workers, {args.rounds} rounds per cell, 128 tokens per request")
    print("| c | policy | CPU µs/round | rounds/s (this loop) | plans | last plan's first shape |")
    print("|---|---|---|---|---|---|")
    for c in [int(x) for x in args.concurrency.split(",")]:
        for adaptive in (False, True) * args.repeat:
            r = asyncio.run(_loop_cell(c, adaptive, args.rounds, tokenizer, vocab, args.fixed_budget,
                                       args.adaptive_learn == "on"))
            print(f"| {c} | {'adaptive' if adaptive else f'tree@{args.fixed_budget}'} | {r['us_per_round']:.1f} | {r['rounds_per_s']:.0f} "
                  f"| {r['plans']} | {', '.join(map(str, r['shapes']))} |", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(_loop_cell(64, True, args.rounds, tokenizer, vocab))
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(s.getvalue())


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (its threads included)."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def run_services(args) -> None:
    from bench import concurrency

    cargs = concurrency.parser().parse_args(["--seconds", str(args.seconds), "--warmup", str(args.warmup),
                                             "--max-tokens", str(args.max_tokens), "--prompts", "10",
                                             "--worker-flags", args.worker_flags,
                                             "--streams-per-client", str(args.streams_per_client),
                                             "--adaptive-cap", str(args.adaptive_cap),
                                             "--orchestrator-flags", args.orchestrator_flags])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops the services too (finally below)
    stack, metrics = concurrency.start_services(cargs, args.log_dir)
    pid = stack.procs["orchestrator"].pid
    rows = []
    try:
        stack.wait_serving()
        from bench import load

        for attempt in range(240):
            try:
                load.worker_state(stack)
                break
            except Exception:
                time.sleep(0.5)
        cpu0, t0 = proc_cpu(pid), time.monotonic()
        time.sleep(args.idle)
        idle = (proc_cpu(pid) - cpu0) / (time.monotonic() - t0)
        print(f"orchestrator CPU while idle: {1000 * idle:.1f} ms/s (subtracted below: net µs/round)", flush=True)
        print("| c | config | rounds | orchestrator CPU s | CPU µs/round | net µs/round | tok/s | mean batch verify / draft "
              "| shapes |", flush=True)
        print("|---|---|---|---|---|---|---|---|---|", flush=True)
        for c in [int(x) for x in args.concurrency.split(",")]:
            for name in args.configs.split(","):
                cargs.concurrency, before = str(c), concurrency.scrape(metrics["orchestrator"])
                cpu0, t0 = proc_cpu(pid), time.monotonic()
                row = concurrency.run_cells(cargs, [name], stack, metrics, log=lambda *a, **k: None)[0]
                cpu, wall = proc_cpu(pid) - cpu0, time.monotonic() - t0
                after = concurrency.scrape(metrics["orchestrator"])
                rounds = sum(v - before.get(k, 0.0) for k, v in after.items()
                             if k[0] == "specdec:round_shape_total")
                rows.append((c, name, rounds, cpu))
                n = max(rounds, 1)
                print(f"| {c} | {name} | {rounds:.0f} | {cpu:.2f} | {1e6 * cpu / n:.0f} | {1e6 * (cpu - idle * wall) / n:.0f} "
                      f"| {row['tok_s']} | {row.get('target_mean_batch_verify', '')} / "
                      f"{row.get('draft_mean_batch_draft', '')} | {row.get('orchestrator_shapes', '')} |", flush=True)
    finally:
        stack.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["planner", "loop", "services"])
    ap.add_argument("--repeat", type=int, default=2, help="loop: fixed / adaptive cell pairs per c")
    ap.add_argument("--fixed-budget", type=int, default=16, help="loop: the fixed requests' tree budget")
    ap.add_argument("--adaptive-learn", choices=("on", "off"), default="on", help="loop: the planner's learning")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--rounds", type=int, default=20000, help="planner: simulated rounds per cell")
    ap.add_argument("--rounds-per-request", type=int, default=43, help="planner: rounds before a request ends")
    ap.add_argument("--profile", action="store_true", help="planner: cProfile the adaptive c=64 cell")
    ap.add_argument("--configs", default="tree@16,adaptive", help="services: bench.concurrency configurations")
    ap.add_argument("--seconds", type=float, default=40.0, help="services: measured seconds per cell")
    ap.add_argument("--warmup", type=float, default=5.0, help="services: warm-up seconds per cell")
    ap.add_argument("--max-tokens", type=int, default=24, help="services: completion tokens per request")
    ap.add_argument("--worker-flags", default="", help="services: flags for both workers")
    ap.add_argument("--orchestrator-flags", default="", help="services: e.g. '--cost-model "
                    "bench/results/cost_model_h200.json' (the H200 planner on CPU workers)")
    ap.add_argument("--streams-per-client", type=int, default=8, help="services: client streams per client process")
    ap.add_argument("--adaptive-cap", type=int, default=64, help="services: tree budget cap of adaptive requests")
    ap.add_argument("--idle", type=float, default=5.0, help="services: seconds of idle orchestrator CPU measured first")
    ap.add_argument("--log-dir", default="/tmp/specdec-adaptive-overhead-logs")
    args = ap.parse_args(argv)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, python {sys.version.split()[0]}, "
          f"loadavg {os.getloadavg()[0]:.2f}", flush=True)
    {"planner": run_planner, "loop": run_loop, "services": run_services}[args.part](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
