"""Where a speculative round's time goes on the GPU (issue 8): per-kernel CUDA time of the
draft call and the verify call, and the host time around them.

python -m bench.round_profile --gguf PATH --prompts-file F [--budgets 16,64] [--out DIR]

In-process (engines + the orchestrator's round loop, greedy, graphs): one bench prompt per
budget, 64 tokens, run once to warm up and once under ``torch.profiler`` (CPU + CUDA, kernels
inside graph replays included). Prints the top kernels by CUDA time and the top host ops,
and writes round_profile.json (+ a Chrome trace per budget) to --out.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch


def main(argv=None) -> int:
    from bench.gpu_fast_path import load, run_mode

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts-file", required=True)
    ap.add_argument("--budgets", default="16,64")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, _, _, tok, target, draft, _ = load(args.gguf, "graphs")
    prompt = json.loads(pathlib.Path(args.prompts_file).read_text())["bench"][:1]
    res = {}
    for budget in [int(b) for b in args.budgets.split(",")]:
        run_mode(tok, target, draft, prompt, "tree", budget, 64)  # warm-up
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            _, row = run_mode(tok, target, draft, prompt, "tree", budget, 64)
        prof.export_chrome_trace(str(out / f"round_profile_tree{budget}.json"))
        ka = prof.key_averages()
        rounds = max(1, round(row["tokens"] / row["tau"]))
        cuda = sorted(ka, key=lambda e: -e.device_time_total)[:40]
        host = sorted(ka, key=lambda e: -e.cpu_time_total)[:40]
        res[f"tree{budget}"] = dict(
            row=row, rounds=rounds,
            kernels_us_per_round=[(e.key[:90], e.count, round(e.device_time_total / rounds, 1)) for e in cuda],
            host_us_per_round=[(e.key[:90], e.count, round(e.cpu_time_total / rounds, 1)) for e in host])
        print(f"== tree {budget}: {json.dumps(row)}")
        print(ka.table(sort_by="device_time_total", row_limit=40, max_name_column_width=70))
        print(ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70))
    (out / "round_profile.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
