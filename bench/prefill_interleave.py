"""Inter-token latency of running streams while long prompts arrive, with and without the step
token budget (issue 14 §5, plans/0009 "Session 6"), in process: ``--streams`` requests decode
(random trees of ``--tree`` nodes, 0 = autoregressive rows; each stream's verify goes through a
real ``serving.batcher.StepBatcher`` from its own thread, as the target servicer runs them) while
long prompts (``--long``, token counts, one after another, each released once its first token
is out) are prefilled on their own threads. Each ``--budgets`` value (engine ``step_tokens``;
0 = no budget: a prompt's chunks fill whole steps) runs once on a fresh engine.

Reported per budget: ITL p50 / p99 / max (ms) of the streams' rounds that ended while a long
prompt was prefilling, and of rounds with no prefill under way (the baseline); TTFT of each long
prompt (ms); the largest step in rows and steps taken (``TargetEngine.step_log``). Random trees
are mostly rejected, so a round ≈ one token; what is measured is the round time.

GPU (H200, after ``bash scripts/device_run.sh K``; ~1.5 min):
  PYTHONPATH=/tmp/site:$PWD python3 -m bench.prefill_interleave --device cuda --streams 16 \\
      --tree 16 --long 2048,7936,2048,7936 --budgets 512,0 --out $OUT/prefill_interleave_h200.md
CPU (the committed CPU figure): python3 -m bench.prefill_interleave --streams 2 --tree 0 \\
      --long 1024,1024 --budgets 256,0 --out bench/results/prefill_interleave_cpu.md
"""
from __future__ import annotations

import argparse
import random
import threading
import time

import numpy as np
import torch


def load(args):
    from modeling.defaults import drafter_config
    from modeling.targets import load_target_model

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_target_model(args.model or None, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    return model, tuple(drafter_config(model.cfg, None).target_layer_ids), device


def run_budget(model, taps, device, args, budget: int) -> dict:
    """One run at ``budget``: returns ITL samples (ms) during / outside prefills, TTFTs, steps."""
    from modeling.acceptance import resolve
    from modeling.sampling import SamplingParams
    from serving.batcher import StepBatcher
    from target_service.engine import TargetEngine, VerifyItem

    fast = "off" if device.type != "cuda" else args.fast
    engine = TargetEngine(model, taps, model.cfg.max_position_embeddings, args.kv_pool_tokens, max(args.tree, 1),
                          fast=fast, prefill_chunk=args.prefill_chunk, step_tokens=budget,
                          max_forward_rows=max(args.tree + 1, 513) if fast != "off" else None)
    batcher = StepBatcher(engine.verify_batch, name="verify")
    V, stop = model.cfg.vocab_size, threading.Event()
    prefilling: list[tuple[float, float]] = []  # (start, first token) of each long prompt
    rounds: list[tuple[float, float]] = []  # (end time, duration) of every stream round
    greedy = SamplingParams()

    def stream(k: int):
        r = random.Random(k)
        rid = f"s{k}"
        mode = "tree" if args.tree else "autoregressive"
        bonus = engine.prefill(rid, [r.randrange(V) for _ in range(32)], args.max_new, greedy, mode,
                               args.tree).first_token
        commit, made, t = None, 0, time.perf_counter()
        while not stop.is_set() and made + args.tree + 2 < args.max_new:
            n = 1 + args.tree
            tokens = [bonus] + r.sample(range(V), n - 1)  # distinct: no repeated sibling
            parents = [-1] + [r.randrange(i) for i in range(1, n)]
            v = batcher.submit(VerifyItem(rid, tokens, parents, commit))
            commit, bonus = resolve(tokens, parents, v.samples)
            made += len(commit)
            now = time.perf_counter()
            rounds.append((now, now - t))
            t = now
        engine.release([rid])

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    r = random.Random(99)
    for i, n in enumerate(args.long):
        t0 = time.perf_counter()
        engine.prefill(f"long{i}", [r.randrange(V) for _ in range(n)], 8, greedy)
        prefilling.append((t0, time.perf_counter()))
        engine.release([f"long{i}"])
        time.sleep(args.gap)
    stop.set()
    for t in threads:
        t.join()
    t_start = prefilling[0][0] - args.warmup / 2  # the streams' own prefills are over by then
    during, outside = [], []
    for end, dt in rounds:
        if end < t_start:
            continue
        # a round that overlapped a prefill window
        (during if any(end - dt < b and end > a for a, b in prefilling) else outside).append(1e3 * dt)
    steps = list(engine.step_log)
    return dict(during=during, outside=outside, ttft=[1e3 * (b - a) for a, b in prefilling],
                max_step=max(d + p for d, p, _ in steps), steps=len(steps))


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="GGUF / HF dir (default: SPECDEC_GGUF or the embedded default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--fast", default="graphs", choices=["graphs", "eager"], help="GPU forward")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tree", type=int, default=16, help="tree nodes per stream round (0: autoregressive)")
    ap.add_argument("--long", default="2048,7936", help="long prompt lengths, arriving one after another")
    ap.add_argument("--budgets", default="512,0", help="step_tokens values to compare (0: no budget)")
    ap.add_argument("--prefill-chunk", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=4096, help="KV rows a stream may commit")
    ap.add_argument("--kv-pool-tokens", type=int, default=1 << 17)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds the streams decode before the first prompt")
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between long prompts")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    args.long = [int(x) for x in args.long.split(",")]
    model, taps, device = load(args)
    lines = [f"# Prefill under the step token budget: ITL of running streams ({device.type})", "",
             f"`python3 -m bench.prefill_interleave --streams {args.streams} --tree {args.tree} "
             f"--long {','.join(map(str, args.long))} --budgets {args.budgets} --prefill-chunk {args.prefill_chunk}`"
             f" — {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, one run.", "",
             "| step_tokens | ITL p50 / p99 / max during prefill (ms) | rounds | ITL p50 / p99 without (ms) "
             "| TTFT of the long prompts (ms) | largest step (rows) | steps |",
             "|---|---|---|---|---|---|---|"]
    for b in [int(x) for x in args.budgets.split(",")]:
        r = run_budget(model, taps, device, args, b)
        d, o = r["during"], r["outside"]
        lines.append(f"| {b or 'none'} | {pct(d, 50):.1f} / {pct(d, 99):.1f} / {max(d, default=float('nan')):.1f} "
                     f"| {len(d)} | {pct(o, 50):.1f} / {pct(o, 99):.1f} | "
                     f"{' / '.join(f'{x:.0f}' for x in r['ttft'])} | {r['max_step']} | {r['steps']} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
