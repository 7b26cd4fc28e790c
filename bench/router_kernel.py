"""The float32 MoE router (specdec_kernels/router.py) at Kimi-K2's shape on one GPU: 384 experts × 7168, bf16
hidden states of M = 1, 8, 32, 64, 65 rows; µs per call (CUDA graph, median) for several blockings
(BR, BN, BK, warps, stages, split-K S) and, for reference, session 17's router through
``specdec_kernels.matmul.linear`` (x widened first, IEEE-fp32 tl.dot, 16 × 64 × 256 tiles, split 14). Prints a
table and the best blocking (least summed time over the tree-verify sizes 8, 32, 64); writes
router_kernel_h200.{md,json}.

python3 -m bench.router_kernel [--out bench/results] [--reps 20] [--tag TAG]
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch

from bench.mla_kernel import graph_ms

N, K = 384, 7168
ROWS = (1, 8, 32, 64, 65)
VERIFY_ROWS = (8, 32, 64)
VARIANTS = [(8, 4, 256, 4, 1, 1), (8, 4, 256, 4, 3, 1), (8, 4, 256, 8, 3, 1), (8, 4, 512, 8, 3, 1),
            (8, 4, 256, 4, 3, 7), (8, 4, 128, 4, 3, 14), (8, 8, 128, 4, 3, 7), (8, 8, 128, 4, 3, 14),
            (8, 16, 64, 4, 3, 14), (4, 8, 128, 4, 3, 14), (16, 4, 128, 4, 3, 7), (8, 8, 64, 4, 3, 28)]
LINEAR = (16, 64, 256, 4, 3, 14)


def main(argv=None) -> None:
    from specdec_kernels.matmul import linear
    from specdec_kernels.router import router_logits, router_logits_reference

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tag", default="")
    a = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    xs = {m: torch.randn(m, K, device="cuda", generator=g).to(torch.bfloat16) for m in ROWS}
    rows = []
    names = ["linear " + ",".join(map(str, LINEAR))] + [",".join(map(str, v)) for v in VARIANTS]
    for name, blocks in zip(names, [None] + VARIANTS):
        r = dict(name=name, us={}, err={})
        for m, x in xs.items():
            fn = (lambda: linear(x.float(), w, tiles=LINEAR)) if blocks is None else \
                 (lambda: router_logits(x, w, blocks))  # noqa: E731
            try:
                want = router_logits_reference(x, w)
                r["err"][m] = (fn().double() - want).abs().max().item() / want.abs().max().item()
                r["us"][m] = graph_ms(fn, a.reps) * 1e3
            except Exception as e:  # noqa: BLE001 (record and go on)
                r["us"][m] = f"{type(e).__name__}: {str(e)[:60]}"
        rows.append(r)
        print(json.dumps(r), flush=True)
    ok = [r for r in rows[1:] if all(isinstance(r["us"][m], float) for m in VERIFY_ROWS)]
    best = min(ok, key=lambda r: sum(r["us"][m] for m in VERIFY_ROWS))["name"] if ok else None
    md = ["# Float32 MoE router logits (specdec_kernels/router.py), " + torch.cuda.get_device_name(), "",
          f"{N} experts × K {K}, bf16 hidden states, float32 weights; µs per call (CUDA graph, median); max "
          "relative error vs float64 in brackets. Blocking: BR, BN, BK, warps, stages, split-K S.", "",
          "| blocking | " + " | ".join(f"M={m} µs" for m in ROWS) + " |", "|---|" + "---|" * len(ROWS)]
    for r in rows:
        md.append(f"| {r['name']}{' **best**' if r['name'] == best else ''} | " + " | ".join(
            f"{v:.1f} ({r['err'][m]:.0e})" if isinstance(v := r["us"][m], float) else str(v) for m in ROWS) + " |")
    md.append("")
    md.append(f"Best (least Σ over M = {', '.join(map(str, VERIFY_ROWS))}): {best}")
    text = "\n".join(md) + "\n"
    print(text)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"router_kernel_h200{a.tag}.md").write_text(text)
    (out / f"router_kernel_h200{a.tag}.json").write_text(json.dumps(dict(rows=rows, best=best), indent=1))
    print(f"ROUTER_BEST={best}")


if __name__ == "__main__":
    main()
