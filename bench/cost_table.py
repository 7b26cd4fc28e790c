"""Cost tables for the adaptive tree budget (``orchestrator.budget.CostModel``), written as the
JSON that ``python -m orchestrator --cost-model PATH`` reads. Two ways:

python -m bench.cost_table [--out bench/results/cost_table_cpu.json] [--reps 9] [--threads 1]
    measures a batch-1 table on this machine's CPU (below);
python -m bench.cost_table --fit-concurrency bench/results/concurrency_h200.json \
        [--out bench/results/cost_model_h200.json]
    fits the model's host and latency terms to a ``bench.concurrency`` run (``bench.cost_fit``).

In-process, the embedded target (float32) and the shipped drafter, prefix 300 tokens:
1. verify: one target engine verify call (commit the previous tree's root + one forward over a
   tree of n rows, n = 1, 2, 5, 17, 33, 65; the CPU serving path);
2. draft: one draft call of the eager draft engine (3 new context rows appended, block
   forward, tree build) for the chain and tree budgets 4, 16, 64;
medians of ``--reps``, all calls interleaved rep by rep (load drift hits every size alike).
The CPU workers run a batch as a loop of per-request calls, so the table puts a one-row
forward into ``host_ms`` (paid per request; + 0.5 ms host work, assumed), the rest of a
verify by rows into ``verify_ms`` and one more draft call into ``draft_ms_per_request``;
``spec_step_ms`` (1 ms) is assumed. Batch-1 measurements only.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time


def round_robin_ms(calls: dict, reps: int) -> dict[str, float]:
    """Median ms of each call, the calls interleaved rep by rep (after one warm-up each)."""
    times = {k: [] for k in calls}
    for rep in range(reps + 1):
        for k, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[k].append(1000 * (time.perf_counter() - t0))
    return {k: round(statistics.median(v), 2) for k, v in times.items()}


def main(argv=None) -> int:
    import torch

    from draft_service.engine import DraftEngine
    from modeling.defaults import DEFAULT_DRAFTER_DIR
    from modeling.dflash import DFlashDrafter
    from modeling.llama import LlamaModel
    from modeling.sampling import SamplingParams
    from modeling.weights import load_target
    from target_service.engine import TargetEngine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="")
    ap.add_argument("--fit-concurrency", default="", metavar="FILE",
                    help="fit the H200 model to this bench.concurrency JSON (several, comma-separated: pooled) instead of measuring (bench.cost_fit)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: on a shared machine more threads spin-wait and cost 10-50x)")
    args = ap.parse_args(argv)
    if args.fit_concurrency:
        from bench import cost_fit

        return cost_fit.main(args.fit_concurrency, args.out or "bench/results/cost_model_h200.json")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg, state = load_target()
    model = LlamaModel.from_state_dict(cfg, state, "cpu", torch.float32)
    drafter = DFlashDrafter.load(DEFAULT_DRAFTER_DIR).eval().requires_grad_(False)
    target = TargetEngine(model, tuple(drafter.config.target_layer_ids), 4096, 1 << 14, 64)
    g = torch.Generator().manual_seed(0)
    sizes, calls = (1, 2, 5, 17, 33, 65), {}
    for n in sizes:  # one request per tree size, measured round-robin (load drift hits every size alike)
        pre = target.prefill(f"t{n}", list(range(100, 400)), 600, SamplingParams(), "tree", 64)
        parents = [-1] + [int(torch.randint(max(0, i - 8), i, (1,), generator=g)) for i in range(1, n)]
        drafts = torch.randperm(cfg.vocab_size, generator=g)[:n - 1].tolist()  # distinct: siblings differ
        st = dict(bonus=pre.first_token, commit=None)

        def call(n=n, st=st, parents=parents, drafts=drafts):  # commit the previous root, verify a new tree
            v = target.verify(f"t{n}", [st["bonus"]] + drafts, parents, st["commit"])
            st["bonus"], st["commit"] = v.samples[0], [0]
        calls[f"verify{n}"] = call

    engine = DraftEngine(drafter, model.model.embed_tokens.weight, model.lm_head.weight, 64)
    width = engine.feature_width
    for mode, budget in [("chain", 1), ("tree", 4), ("tree", 16), ("tree", 64)]:
        name = f"{mode}{budget if mode == 'tree' else ''}"
        with torch.inference_mode():
            engine.draft(name, torch.zeros(300, width), 0, 5, mode, budget)
        start = [300]

        def call(name=name, start=start):  # 3 new context rows + one draft
            with torch.inference_mode():
                engine.draft(name, torch.zeros(3, width), start[0], 5)
            start[0] += 3
        calls[name] = call
    ms = round_robin_ms(calls, args.reps)
    for k, v in ms.items():
        print(f"{k:10s} {v:8.2f} ms", flush=True)
    verify = [[n, ms[f"verify{n}"]] for n in sizes]
    draft = ms

    base = min(ms for _, ms in verify[:2])  # one row's forward: paid per request on the CPU
    table = dict(verify_ms=[[n, round(max(ms - base, 0.0), 2)] for n, ms in verify], chain_draft_ms=draft["chain"],
                 draft_ms=[[b, draft[f"tree{b}"]] for b in (4, 16, 64)],
                 draft_ms_per_request=draft["tree4"], host_ms=round(base + 0.5, 2), spec_step_ms=1.0,
                 block_size=drafter.config.block_size,
                 measured=dict(device="cpu", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               threads=torch.get_num_threads(), reps=args.reps, prefix=300, verify_ms=verify,
                               note="batch 1. The CPU workers run a batch as a loop of per-request calls, so a "
                                    "one-row forward is host_ms (paid per request, + 0.5 ms assumed host work), "
                                    "verify_ms the cost above it by rows, draft_ms_per_request one more tree@4 "
                                    "call; spec_step_ms assumed"))
    out = pathlib.Path(args.out or "bench/results/cost_table_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
