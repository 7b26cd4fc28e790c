"""What one batched draft call costs (issue 14; plans/0009 "What to measure", item 1): ms of
``DraftEngine.draft_batch`` over b requests against b single-request ``draft`` calls, per
shape (chain, tree budgets), CUDA graphs, bf16, the shipped drafter with the target's
embedding and LM head.

python -m bench.draft_batch_costs [--gguf PATH] [--batches 1,4,16,64] [--budgets 4,16,64]
                                  [--rounds 30] [--context 300] [--new-rows 3] [--tag h200] [--out bench/results]

Per (b, shape): b requests open with a ``--context``-row prompt (eager append, one batch),
then each round appends ``--new-rows`` random feature rows per request and drafts (the usual
round: the rows go through the batch graph's append). The same inputs are drafted twice, by
requests ``b*`` in one ``draft_batch`` and by requests ``s*`` one ``draft`` call each, so the
table also says whether every batched tree equals its solo tree (``same``). Times are wall ms
per call on the host (``draft_batch`` returns after its device → host copy), median and p90
over ``--rounds`` after 3 warm-up rounds. Also: graph capture seconds (all graphs and the batch
graphs' share) and the device memory the batch graphs add (a max_batch=1 engine against the
measured one). Fitted per shape: ms = a + per_request · b (least squares over the batches),
the ``draft_ms_per_request`` of ``orchestrator.budget.CostModel``.
Prints a table; writes draft_batch_costs_<tag>.json and .md to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

import torch


def engine_and_memory(drafter, embed, head, max_batch: int, pool: int):
    """(engine, MiB the engine reserved on the device: pool, buffers, graphs)."""
    from draft_service.engine import DraftEngine

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    e = DraftEngine(drafter, embed, head, 512, fast="graphs", context_pool_tokens=pool, max_batch=max_batch)
    torch.cuda.synchronize()
    return e, round((free0 - torch.cuda.mem_get_info()[0]) / 2 ** 20, 1)


def measure(e, b: int, mode: str, budget: int, args, g: torch.Generator) -> dict:
    from draft_service.engine import DraftItem

    w, V = e.feature_width, e.cfg.vocab_size
    bind = dict(mode=mode, budget=budget if mode == "tree" else None)
    start, batch_ms, loop_ms, same = 0, [], [], 0
    for r in range(args.rounds + 4):
        n = args.context if r == 0 else args.new_rows
        feats = [torch.randn(n, w, generator=g) for _ in range(b)]
        bonus = torch.randint(0, V, (b,), generator=g).tolist()
        items = [DraftItem(f"b{i}", feats[i], start, bonus[i], **(bind if r == 0 else {})) for i in range(b)]
        t0 = time.perf_counter()
        got = e.draft_batch(items)
        t1 = time.perf_counter()
        want = [e.draft(f"s{i}", feats[i], start, bonus[i], **(bind if r == 0 else {})) for i in range(b)]
        t2 = time.perf_counter()
        bad = [x for x in got if isinstance(x, Exception)]
        if bad:
            raise bad[0]
        start += n
        if r >= 4:  # round 0 opens (long append), 1-3 warm up
            batch_ms.append(1000 * (t1 - t0))
            loop_ms.append(1000 * (t2 - t1))
            same += got == want
    e.release([f"{p}{i}" for p in "bs" for i in range(b)])
    q = lambda xs, f: round(statistics.quantiles(xs, n=10)[8] if f == 0.9 else statistics.median(xs), 3)
    return dict(batch=b, shape="chain" if mode == "chain" else f"tree@{budget}",
                batch_ms=q(batch_ms, 0.5), batch_p90_ms=q(batch_ms, 0.9), per_request_ms=round(q(batch_ms, 0.5) / b, 4),
                loop_ms=q(loop_ms, 0.5), speedup=round(q(loop_ms, 0.5) / q(batch_ms, 0.5), 2),
                same=f"{same}/{args.rounds}")


def fit(rows: list[dict]) -> dict:
    """Per shape, least squares ms = a + per_request · b over the measured batches."""
    out = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        pts = [(r["batch"], r["batch_ms"]) for r in rows if r["shape"] == shape]
        if len(pts) < 2:
            continue
        mb, mm = (sum(x) / len(pts) for x in zip(*pts))
        slope = sum((b - mb) * (m - mm) for b, m in pts) / sum((b - mb) ** 2 for b, _ in pts)
        out[shape] = dict(ms_at_0=round(mm - slope * mb, 3), per_request_ms=round(slope, 4))
    return out


def main(argv=None) -> int:
    from modeling.defaults import DEFAULT_DRAFTER_DIR
    from modeling.dflash import DFlashDrafter
    from modeling.weights import load_embedding_and_head

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=os.environ.get("SPECDEC_GGUF") or None,
                    help="target GGUF for the embedding and LM head (default: $SPECDEC_GGUF, else the embedded model)")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--budgets", default="4,16,64", help="tree budgets (the chain is always measured)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--context", type=int, default=300, help="prompt rows per request")
    ap.add_argument("--new-rows", type=int, default=3, help="context rows appended per request per round")
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("draft_batch_costs needs a CUDA device (the batch graphs)")
    batches = [int(x) for x in args.batches.split(",")]
    shapes = [("chain", 0)] + [("tree", int(x)) for x in args.budgets.split(",")]
    dev, dt = torch.device("cuda"), torch.bfloat16
    _, embed, head = load_embedding_and_head(args.gguf)
    embed, head = embed.to(dev, dt), head.to(dev, dt)
    drafter = DFlashDrafter.load(DEFAULT_DRAFTER_DIR).to(dev, dt).eval().requires_grad_(False)
    B = drafter.config.block_size
    pool = 2 * max(batches) * 2 * (args.context + (args.rounds + 4) * args.new_rows + 2 * B)  # b* and s*, doubling
    one, mem_one = engine_and_memory(drafter, embed, head, 1, pool)
    capture_one = one.fast.capture_seconds
    del one
    e, mem = engine_and_memory(drafter, embed, head, max(batches), pool)
    res = dict(tag=args.tag, device=torch.cuda.get_device_name(), block_size=B, context=args.context,
               new_rows=args.new_rows, rounds=args.rounds, batch_buckets=e.fast.batch_buckets,
               budget_buckets=e.fast.buckets, graphs=len(e.fast.graphs),
               capture_s=round(e.fast.capture_seconds, 2), batch_capture_s=round(e.fast.batch_capture_seconds, 2),
               capture_s_max_batch_1=round(capture_one, 2), engine_mib=mem, engine_mib_max_batch_1=mem_one)
    print(f"{res['graphs']} graphs captured in {res['capture_s']} s (batch graphs {res['batch_capture_s']} s; "
          f"max_batch 1: {res['capture_s_max_batch_1']} s); engine {mem} MiB (max_batch 1: {mem_one} MiB)", flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'batch':>5} {'shape':>8} {'batch ms':>9} {'p90':>7} {'ms/req':>7} {'loop ms':>8} {'x':>6} {'same':>6}")
    for b in batches:
        for mode, budget in shapes:
            r = measure(e, b, mode, budget, args, g)
            rows.append(r)
            print(f"{b:>5} {r['shape']:>8} {r['batch_ms']:>9.3f} {r['batch_p90_ms']:>7.3f} {r['per_request_ms']:>7.3f} "
                  f"{r['loop_ms']:>8.3f} {r['speedup']:>6.2f} {r['same']:>6}", flush=True)
    res["rows"], res["fit"] = rows, fit(rows)
    print("fit ms = a + per_request · b:", json.dumps(res["fit"]))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"draft_batch_costs_{args.tag}.json").write_text(json.dumps(res, indent=1))
    md = [f"# Batched draft call, {res['device']} ({args.tag})", "",
          f"{res['graphs']} graphs, capture {res['capture_s']} s (batch graphs {res['batch_capture_s']} s); "
          f"engine {mem} MiB on the device (max_batch 1: {mem_one} MiB). Context {args.context} rows, "
          f"{args.new_rows} new rows per request per round, {args.rounds} rounds.", "",
          "| batch | shape | batch ms | p90 | ms/request | b solo calls ms | speedup | batch == solo |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['batch']} | {r['shape']} | {r['batch_ms']} | {r['batch_p90_ms']} | {r['per_request_ms']} | "
           f"{r['loop_ms']} | {r['speedup']} | {r['same']} |" for r in rows]
    md += ["", "Fit ms = a + per_request · b: " + ", ".join(f"{s}: {f['ms_at_0']} + {f['per_request_ms']}·b"
                                                          for s, f in res["fit"].items())]
    (out / f"draft_batch_costs_{args.tag}.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
