"""What the worker's step batcher (``serving.batcher.StepBatcher``) costs and how its batches
form, with a synthetic engine call (a sleep) instead of a model.

  python -m bench.batcher_overhead [--callers 1,8,32] [--batch-ms 1.0] [--think-ms 0,2]
      [--wait-us 0,250,1000] [--seconds 3] [--out bench/results/batcher_overhead_cpu.md]

- submit round trip: one caller, a run_batch that returns at once — the batcher's own cost per
  message (lock, queue, result) against a plain call;
- closed loop: c caller threads (one per request stream); each submits, waits for its result,
  "thinks" for a uniform 0…think-ms (the orchestrator's turn-around between a request's rounds),
  submits again. run_batch sleeps batch-ms (a forward whose cost hardly depends on its rows, as
  the H200 verify up to ~65 rows). Per (c, think, wait): messages/s, mean batch, mean wait per
  message (submit → result, ms). Self-clocking batches split lock-step callers into groups;
  a gather window (``--batch-wait-us``) trades a little latency for fuller batches; it ends
  once every caller's message is queued (``expected``, as the workers count live requests).
"""
from __future__ import annotations

import argparse
import pathlib
import platform
import random
import threading
import time

from serving.batcher import StepBatcher

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def round_trip(n: int = 5000) -> tuple[float, float]:
    """(µs per submit through the batcher, µs per plain call) with a no-op batch function."""
    b = StepBatcher(lambda items: items)
    for _ in range(200):
        b.submit(0)
    t = time.perf_counter()
    for _ in range(n):
        b.submit(0)
    batched = (time.perf_counter() - t) / n * 1e6
    lock = threading.Lock()

    def plain(x):
        with lock:
            return x
    t = time.perf_counter()
    for _ in range(n):
        plain(0)
    return batched, (time.perf_counter() - t) / n * 1e6


def closed_loop(callers: int, batch_ms: float, think_ms: float, wait_us: int, seconds: float) -> dict:
    """Run ``callers`` closed-loop threads against one batcher for ``seconds``."""
    b = StepBatcher(lambda items: (time.sleep(batch_ms / 1e3), items)[1], max_batch=64, wait_s=wait_us / 1e6,
                    expected=lambda: callers)  # every caller is a live request, as the servicers count them
    stop = time.monotonic() + seconds
    waits: list[float] = []

    def caller(seed: int):
        rng = random.Random(seed)
        while time.monotonic() < stop:
            t = time.perf_counter()
            b.submit(seed)
            waits.append(time.perf_counter() - t)
            if think_ms:
                time.sleep(rng.uniform(0, think_ms) / 1e3)
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    return dict(callers=callers, think_ms=think_ms, wait_us=wait_us, per_s=b.items / elapsed,
                mean_batch=b.items / max(b.batches, 1), mean_wait_ms=1e3 * sum(waits) / max(len(waits), 1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.batcher_overhead", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--callers", default="1,8,32", help="comma-separated closed-loop caller counts")
    ap.add_argument("--batch-ms", type=float, default=1.0, help="the synthetic engine call's duration")
    ap.add_argument("--think-ms", default="0,2", help="comma-separated: each caller's turn-around, uniform 0..x ms")
    ap.add_argument("--wait-us", default="0,250,1000", help="comma-separated gather windows")
    ap.add_argument("--seconds", type=float, default=3.0, help="per closed-loop cell")
    ap.add_argument("--out", default=str(RESULTS / "batcher_overhead_cpu.md"))
    args = ap.parse_args(argv)
    batched, plain = round_trip()
    lines = [f"# StepBatcher overhead and batch formation ({platform.node()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "", f"`python -m bench.batcher_overhead --callers {args.callers} --batch-ms {args.batch_ms} --think-ms "
             f"{args.think_ms} --wait-us {args.wait_us} --seconds {args.seconds}`; load average before: "
             f"{open('/proc/loadavg').read().split()[:3]}", "",
             f"submit round trip, one caller, no-op batch: {batched:.1f} µs (a plain locked call: {plain:.2f} µs)", "",
             f"closed loop, engine call {args.batch_ms} ms (a sleep), max batch 64:", "",
             "| callers | think ms | wait µs | messages/s | mean batch | mean wait per message ms |", "|---|---|---|---|---|---|"]
    for c in map(int, args.callers.split(",")):
        for think in map(float, args.think_ms.split(",")):
            for w in map(int, args.wait_us.split(",")):
                r = closed_loop(c, args.batch_ms, think, w, args.seconds)
                lines.append(f"| {c} | {think:g} | {w} | {r['per_s']:.0f} | {r['mean_batch']:.2f} | {r['mean_wait_ms']:.2f} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
