"""The DDTree build on the GPU (issue 8: tree build ≤ 100 µs at budget 64).

python -m bench.ddtree_kernel [--out DIR]

"Tree build" = from the drafter's float32 logits [1, D = 7, V = 49152] to the tree: the ranked
top-K log-probs per depth (``draft_service.fast_draft.ranked_log_probs``: the two-launch fused
top-K of ``specdec_kernels.topk_logprobs`` for K ≤ 64, log_softmax + torch.topk above) and the
one-launch best-first kernel (``specdec_kernels.ddtree_build``) — what the drafter's propose graph runs
(``full_build_us``).
1. Correctness at the serving shape (bf16-rounded logits, so token ties occur) and with exact
   score ties (integer logits, V = 1000): the kernel's tree equals the literal best-first
   reference (``draft_service.ddtree.build_ddtree_reference``) node for node; the fused top-K's
   ids equal a stable descending ranking and its log-probs are within 2e-6 of float64.
2. Time per call inside a CUDA graph (CUDA events; the graph holds 10 calls back to back,
   median of 10 replays / 10, so the graph launch itself is not counted): the best-first kernel
   alone (at budgets 64 and 512 also at 1, 2, 4 warps); the fused top-K and log_softmax +
   torch.topk; the full build, and the same with torch's top-K (the session-4 first cut); the
   batched torch builder (``draft_service.ddtree.build_ddtree``).
Prints a table and writes ddtree_kernel.json to --out. About a minute on an H200 (compiles).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import torch

from bench.kernel_tiles import per_launch_ms
from draft_service.ddtree import _log_probs, build_ddtree, build_ddtree_reference
from draft_service.fast_draft import ranked_log_probs
from specdec_kernels.ddtree_build import build_ddtree_topk, num_warps_for
from specdec_kernels.topk_logprobs import MAX_K, topk_log_probs, topk_log_probs_reference

BUDGETS = (1, 4, 16, 64, 128, 256, 512)
D, V = 7, 49152  # the drafter: block_size 8 → depths 1…7; SmolLM2 vocabulary


def graph_us(fn) -> float:
    """µs per call from a CUDA graph of 10 calls (``bench.kernel_tiles.per_launch_ms``)."""
    return 1000 * per_launch_ms(fn, 10)


def ranked(logits: np.ndarray, K: int):
    lp = _log_probs(torch.from_numpy(logits))
    ids = torch.from_numpy(np.argsort(-lp.numpy(), axis=-1, kind="stable")[..., :K].copy())
    return lp.gather(-1, ids).cuda(), ids.cuda()


def correctness(rng) -> list[dict]:
    rows = []
    for budget in BUDGETS:
        for name, logits in [("bf16 V=49152", torch.from_numpy(rng.standard_normal((2, D, V)).astype(np.float32) * 3)
                              .bfloat16().float().numpy()),
                             ("int ties V=1000", rng.integers(0, 4, (2, D, 1000)).astype(np.float32))]:
            roots = rng.integers(0, 1000, 2)
            top_lp, top_ids = ranked(logits, min(budget, logits.shape[-1]))
            refs = [build_ddtree_reference(logits[r], int(roots[r]), budget) for r in range(2)]
            nodes, scores, count = build_ddtree_topk(top_lp, top_ids, torch.from_numpy(roots).cuda(), budget)
            ok = True
            for r, ref in enumerate(refs):
                n = len(ref.tokens)
                ok &= int(count[r]) == n - 1 and all(nodes[r, i, :n].tolist() == getattr(ref, f).tolist()
                                                     for i, f in enumerate(("tokens", "parents", "depths")))
                ok &= bool(np.array_equal(scores[r, :n].cpu().numpy(), ref.scores))
            rows.append(dict(check="tree", budget=budget, inputs=name, identical=bool(ok)))
            if budget <= MAX_K:
                x = torch.from_numpy(logits).cuda()
                lp, ids = topk_log_probs(x, budget)
                want_lp, want_ids = topk_log_probs_reference(x, budget)
                err = float((lp.double() - want_lp).abs().max())
                rows.append(dict(check="fused top-K", budget=budget, inputs=name, max_abs_lp_err=err,
                                 identical=bool(torch.equal(ids, want_ids)) and err <= 2e-6))
    return rows


def timings(rng) -> list[dict]:
    logits = torch.from_numpy(rng.standard_normal((1, D, V)).astype(np.float32) * 3).cuda()
    root = torch.tensor([1], device="cuda")
    rows = []
    for budget in BUDGETS:
        bt = torch.tensor([budget], device="cuda")
        top_lp, top_ids = _log_probs(logits).topk(budget, dim=-1)
        row = dict(budget=budget, warps=num_warps_for(triton_slots(budget)))
        row["kernel_us"] = graph_us(lambda: build_ddtree_topk(top_lp, top_ids, root, bt, budget))
        if budget in (64, 512):
            for w in (1, 2, 4):
                row[f"kernel_{w}w_us"] = graph_us(
                    lambda w=w: build_ddtree_topk(top_lp, top_ids, root, bt, budget, num_warps=w))
        if budget <= MAX_K:
            row["topk_fused_us"] = graph_us(lambda: topk_log_probs(logits, budget))
        row["topk_torch_us"] = graph_us(lambda: _log_probs(logits).topk(budget, dim=-1))
        row["full_build_us"] = graph_us(lambda: build_ddtree_topk(*ranked_log_probs(logits, budget), root, bt, budget))
        row["full_build_torch_topk_us"] = graph_us(
            lambda: build_ddtree_topk(*_log_probs(logits).topk(budget, dim=-1), root, bt, budget))
        row["torch_builder_us"] = graph_us(lambda: build_ddtree(logits, root, budget, visibility=False))
        rows.append(row)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return rows


def triton_slots(budget: int) -> int:
    return 1 << budget.bit_length()  # next power of two >= budget + 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corr = correctness(rng)
    for c in corr:
        print(c)
    print("all identical:", all(c["identical"] for c in corr), flush=True)
    (out / "ddtree_kernel.json").write_text(json.dumps(dict(correctness=corr), indent=1))
    rows = timings(rng)
    cols = sorted({c for r in rows for c in r}, key=lambda c: (c not in ("budget", "warps"), "w_us" in c, c))
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols) + " |")
    (out / "ddtree_kernel.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, correctness=corr, timings_us=rows), indent=1))
    print("all identical:", all(c["identical"] for c in corr))


if __name__ == "__main__":
    main()
