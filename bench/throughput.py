"""Tokens/s and τ of autoregressive, chain and tree modes through the real gRPC stack.

python -m bench.throughput [--prompts 10] [--max-tokens 64] [--budgets 4,16,64]

Starts the three services (embedded default model, whichever device they pick), runs every
mode on the same prompts (5 HumanEval + 5 MT-Bench by default, greedy), prints a table and
writes bench/results/throughput_<device>.json and .md. Speedup = AR wall time ÷ mode wall
time over the same prompts and tokens, measured in one run.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def prompts(n: int) -> list[dict]:
    """n held-out prompts: the last HumanEval prompts and the last MT-Bench first turns."""
    from bench.datasets import humaneval_prompts, mtbench_questions

    code, chat = humaneval_prompts()[-(n - n // 2):], mtbench_questions()[-(n // 2):]
    return [dict(prompt=p) for p in code] + [dict(messages=[{"role": "user", "content": c}]) for c in chat]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budgets", default="4,16,64")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)

    from deploy.local import start_stack
    from specdec_client import SpecDecClient

    modes = [("autoregressive", 0), ("chain", 0)] + [("tree", int(b)) for b in args.budgets.split(",")]
    ps = prompts(args.prompts)
    stack = start_stack(log_dir="/tmp")
    rows = []
    try:
        stack.wait_serving()
        with SpecDecClient(stack.address) as c:
            c.generate(prompt="warm up", max_tokens=8, mode="tree", tree_budget=max(b for _, b in modes))
            ref = None
            for mode, budget in modes:
                t0, toks, taus, exp, outs = time.perf_counter(), 0, [], [], []
                for p in ps:
                    r = c.generate(**p, max_tokens=args.max_tokens, mode=mode, tree_budget=budget, ignore_eos=True)
                    toks += r.completion_tokens
                    taus.append(r.stats.mean_accept_length)
                    exp.append(r.stats.expected_accept_length)
                    outs.append(r.token_ids)
                dt = time.perf_counter() - t0
                if ref is None:
                    ref = (outs, dt)
                rows.append(dict(mode=mode, budget=budget, tokens=toks, seconds=round(dt, 3),
                                 tokens_per_s=round(toks / dt, 2), tau=round(sum(taus) / len(taus), 3),
                                 expected_tau=round(sum(exp) / len(exp), 3), speedup=round(ref[1] / dt, 3),
                                 identical_to_ar=outs == ref[0]))
    finally:
        stack.stop()
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu-{platform.machine()}"
    tag = args.tag or ("gpu" if torch.cuda.is_available() else "cpu")
    head = f"| mode | budget | tokens | s | tok/s | τ | E[τ] | speedup vs AR | identical |\n|---|---|---|---|---|---|---|---|---|"
    lines = [f"| {r['mode']} | {r['budget'] or '-'} | {r['tokens']} | {r['seconds']} | {r['tokens_per_s']} | "
             f"{r['tau']} | {r['expected_tau']} | {r['speedup']} | {r['identical_to_ar']} |" for r in rows]
    meta = dict(device=device, prompts=len(ps), max_tokens=args.max_tokens, temperature=0,
                service_threads=1, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    table = "\n".join([head] + lines)
    print(json.dumps(meta))
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"throughput_{tag}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    (RESULTS / f"throughput_{tag}.md").write_text(f"# Throughput ({tag})\n\n`{json.dumps(meta)}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
