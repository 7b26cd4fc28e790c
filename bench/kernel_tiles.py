"""Choose the fixed tilings of the row-invariant kernels on the GPU (issue 8). No weights needed.

python -m bench.kernel_tiles [--out DIR] [--kimi-tp8]

1. ``specdec_kernels.matmul.linear``: for every weight shape (N, K) of the embedded target
   (SmolLM2-135M) and of the drafter, each candidate tiling is timed per launch (a CUDA graph of
   20 launches, median of 10 replays) at the row counts that shape sees in serving; the winner
   minimises the time summed over those row counts with WEIGHT (trees of ≤ 64 nodes are the
   serving sweet spot; 257/513-row verifies count less). A tiling is a function of the weight's shape
   only, so rows stay invariant whatever M is.
2. ``specdec_kernels.tree_attention``: each (BLOCK_N, warps) timed at 1, 17 and 65 query rows of
   DDTree-shaped trees (depth ≤ 7) over prefixes of 300 and 1000 keys.
3. The verify forward (random weights, CUDA graphs, prefix 300) with the default tilings and
   with the winners, per row bucket, and a per-kernel GPU-time profile of the winner at 1 row.
Prints tables and writes kernel_tiles.json (paste the winners into specdec_kernels/matmul.py's
TILE_TABLE and specdec_kernels/tree_attention.py's defaults). --kimi-tp8: step 1 only, over the weight
shapes of one Kimi-K2 rank under TP8 (KIMI_TP8_SHAPES), written to kernel_tiles_kimi_tp8.json.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
import pathlib
import statistics

import numpy as np
import torch

H, I, V, TAPS = 576, 1536, 49152, 3
# (N, K) → row counts it sees: target verify (1 AR … 65 tree@64) and drafter (≤ 8-row blocks)
TARGET_M, DRAFT_M = (1, 8, 17, 65, 257, 513), (1, 8)
WEIGHT = {1: 1.0, 8: 1.0, 17: 1.0, 65: 1.0, 257: 0.25, 513: 0.1}
SHAPES = {(960, H): TARGET_M, (H, H): TARGET_M, (2 * I, H): TARGET_M, (H, I): TARGET_M,
          (V, H): TARGET_M, (H, TAPS * H): DRAFT_M, (384, H): DRAFT_M}
# one Kimi-K2 rank under TP8 (8 heads; replicated q_a / kv_a; absorption as one block-diagonal matmul at 8
# heads; expert, shared-expert and dense-MLP slices of I/8; vocabulary-parallel LM head, fp32 out); verify rows
KIMI_M = (1, 8, 17, 65)
KIMI_TP8_SHAPES = {(1536, 7168): KIMI_M, (1536, 1536): KIMI_M, (576, 7168): KIMI_M, (4096, 1024): KIMI_M,
                   (1024, 4096): KIMI_M, (7168, 1024): KIMI_M, (256, 7168): KIMI_M, (7168, 256): KIMI_M,
                   (2304, 7168): KIMI_M, (7168, 2304): KIMI_M, (20480, 7168): KIMI_M,
                   (512, 7168): KIMI_M}  # (the shared expert's gate and up stacked: modeling.deepseek_fast)
FP32_OUT = {(V, H), (20480, 7168)}  # LM heads: fp32 logits, no residual
ROUTER = (384, 7168)  # the fp32 router through linear (sessions 16–18; specdec_kernels.router since 19): IEEE products
SPLITS = (1, 2, 4, 7, 14)  # --split: split-K counts tried on top of each shape's tilings
CANDIDATES = [(bm, bn, bk, w, s) for bm, bn, bk in itertools.product((16, 32, 64), (32, 64, 128), (64, 128, 256))
              for w, s in ((4, 3),)] + [(64, 128, 64, 8, 3), (128, 64, 64, 8, 3), (64, 256, 64, 8, 3), (32, 32, 128, 4, 4)]
ATTN = [(bn, w) for bn in (16, 32, 64, 128, 256) for w in (2, 4, 8)]


def per_launch_ms(fn, n: int = 20) -> float:
    """GPU milliseconds per call of fn, from a CUDA graph of n calls (no launch overhead)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / n)
    return statistics.median(times)


def split_candidates(n: int, k: int) -> list[tuple]:
    """--split: the shape's table tiling and narrow-tile variants, each at every count of SPLITS."""
    from specdec_kernels.matmul import tiles_for

    base = {tuple(tiles_for(n, k))[:5], (16, 32, 256, 4, 3), (16, 64, 256, 4, 3), (16, 32, 128, 4, 3),
            (32, 64, 128, 4, 3), (16, 16, 128, 4, 3), (64, 64, 128, 4, 3)}
    return [t + (s,) for t in sorted(base) for s in SPLITS]


def sweep_linear(shapes: dict = SHAPES, split: bool = False) -> tuple[dict, dict]:
    from specdec_kernels.matmul import linear

    best, table = {}, {}
    for (n, k), ms in shapes.items():
        dt = torch.float32 if (n, k) == ROUTER else torch.bfloat16
        w = torch.randn(n, k, device="cuda", dtype=dt) * 0.02
        xs = {m: torch.randn(m, k, device="cuda", dtype=dt) for m in ms}
        res = {m: torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for m in ms}
        lm_head = (n, k) in FP32_OUT or (n, k) == ROUTER
        out_dt = torch.float32 if lm_head else None
        scores = {}
        for t in split_candidates(n, k) if split else CANDIDATES:
            try:
                times = [per_launch_ms(lambda m=m: linear(xs[m], w, None if lm_head else res[m], out_dt, tiles=t))
                         for m in ms]
            except Exception as e:  # a tiling that does not fit shared memory / registers
                print(f"  skip {t} for {(n, k)}: {type(e).__name__}", flush=True)
                continue
            scores[t] = times
        win = min(scores, key=lambda t: sum(WEIGHT[m] * x for m, x in zip(ms, scores[t])))
        default = scores.get((64, 64, 128, 4, 3) + ((1,) if split else ()))
        best[(n, k)] = win
        table[f"{n},{k}"] = {",".join(map(str, t)): [round(x * 1000, 2) for x in v] for t, v in scores.items()}
        print(f"| {n}×{k} | {ms} | {win} | {[round(x * 1000, 1) for x in scores[win]]} | "
              f"{[round(x * 1000, 1) for x in default] if default else '-'} |", flush=True)
    return best, table


def ddtree_like(n: int, rng) -> list[int]:
    parents, depth = [-1], [0]
    for i in range(1, n):
        p = int(rng.choice([j for j in range(i) if depth[j] < 7]))
        parents.append(p)
        depth.append(depth[p] + 1)
    return parents


ATTN_CASES = [(300, 1), (300, 17), (300, 65), (300, 257), (1000, 1), (1000, 17), (1000, 65), (4000, 1)]
ATTN_WEIGHT = (1, 1, 1, 0.25, 1, 1, 1, 0.5)


def sweep_attention() -> tuple[tuple[int, int], dict]:
    from specdec_kernels.tree_attention import tree_attention
    from modeling.tree import tree_ancestors

    rng = np.random.default_rng(0)
    kp = torch.randn(8192, 3, 64, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    cases = []
    for L, n in ATTN_CASES:
        depths, anc = tree_ancestors(ddtree_like(n, rng))
        cases.append((L, n, torch.randn(n, 9, 64, device="cuda", dtype=torch.bfloat16),
                      torch.from_numpy(L + depths).cuda(), torch.from_numpy(anc.reshape(-1)).cuda(),
                      torch.tensor([1, L, anc.shape[1]], device="cuda")))
    scores = {}
    for t in ATTN:
        scores[t] = [per_launch_ms(lambda c=c: tree_attention(c[2], kp, vp, c[3], c[4], c[5], tiles=t)) for c in cases]
        print(f"| {t} | " + " | ".join(f"{x * 1000:.1f}" for x in scores[t]) + " |", flush=True)
    win = min(scores, key=lambda t: sum(w * x for w, x in zip(ATTN_WEIGHT, scores[t])))
    return win, {f"{bn},{w}": [round(x * 1000, 2) for x in v] for (bn, w), v in scores.items()}


def random_target():
    """The row-invariant forward of a random-weight model of SmolLM2-135M's shape (bf16)."""
    from modeling.config import LlamaConfig
    from modeling.fast_forward import RowInvariantLlama
    from modeling.kv_cache import KVPool
    from modeling.llama import LlamaModel

    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0)
    torch.manual_seed(0)
    model = LlamaModel(cfg).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    pool = KVPool(cfg.num_hidden_layers, 4096, cfg.num_key_value_heads, cfg.head_dim, "cuda", torch.bfloat16)
    pool.k.normal_(), pool.v.normal_()
    return RowInvariantLlama(model, pool, (1, 14, 27))


def forward_times(label: str) -> tuple:
    """(graph replay ms per row bucket, the forward, its graphs)."""
    from bench.gpu_fast_path import cuda_ms
    from modeling.graphs import VerifyGraphs
    from modeling.tree import tree_ancestors

    fwd = random_target()
    graphs = VerifyGraphs(fwd, 513, torch.device("cuda"))
    graphs.capture()
    rng = np.random.default_rng(1)
    row = dict(variant=label)
    for n in (1, 8, 17, 65, 257, 513):
        depths, anc = tree_ancestors(ddtree_like(n, rng))
        args = (rng.integers(0, V, n).tolist(), depths, anc, 1, 300)
        with torch.inference_mode():
            graphs(*args)
            g = graphs.graphs[graphs.bucket(n)][0]
            row[n] = round(cuda_ms(g.replay), 3)
    print(json.dumps(row), flush=True)
    return row, fwd, graphs


def profile(fwd, graphs) -> dict:
    inputs = graphs.inputs
    per = collections.defaultdict(float)
    with torch.inference_mode():
        inputs.load([0], np.zeros(1, np.int64), np.zeros((1, 1), np.int32), 1, 300, 1)
        for _ in range(3):
            fwd(*inputs.views(1))
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fwd(*inputs.views(1))
            torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:40]] += e.device_time_total / 5 / 1000
    return {k: round(v, 4) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--kimi-tp8", action="store_true", help="only the linear sweep, at one Kimi-K2 TP8 rank's shapes")
    ap.add_argument("--split", action="store_true", help="with --kimi-tp8: split-K counts over a few tilings per "
                    "shape (and the fp32 router), written to kernel_tiles_kimi_tp8_split.json")
    args = ap.parse_args(argv)
    import specdec_kernels.matmul as mm
    import specdec_kernels.tree_attention as ta

    print("| weight N×K | rows | best tiling | µs per launch at those rows | default 64,64,128,4,3 |\n|---|---|---|---|---|")
    if args.kimi_tp8:
        shapes = {**KIMI_TP8_SHAPES, **({ROUTER: KIMI_M} if args.split else {})}
        best, table = sweep_linear(shapes, split=args.split)
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = "kernel_tiles_kimi_tp8_split.json" if args.split else "kernel_tiles_kimi_tp8.json"
        (out / name).write_text(json.dumps(dict(
            linear={f"{n},{k}": list(t) for (n, k), t in best.items()}, rows=list(KIMI_M), linear_all=table), indent=1))
        return 0
    linear_best, linear_all = sweep_linear()
    print("\n| attention (BLOCK_N, warps) | " + " | ".join(f"L={L} n={n}" for L, n in ATTN_CASES)
          + " |\n|---|" + "---|" * len(ATTN_CASES))
    attn_best, attn_all = sweep_attention()
    print("attention winner", attn_best)
    before, _, g = forward_times("default tilings")
    del g
    mm.TILE_TABLE.update(linear_best)
    ta.BLOCK_N, ta.NUM_WARPS = attn_best
    after, fwd, graphs = forward_times("tuned tilings")
    prof = profile(fwd, graphs)
    print("\n| verify graph replay ms | " + " | ".join(f"{n} rows" for n in (1, 8, 17, 65, 257, 513))
          + " |\n|---|" + "---|" * 6)
    for r in (before, after):
        print(f"| {r['variant']} | " + " | ".join(str(r[n]) for n in (1, 8, 17, 65, 257, 513)) + " |")
    print("\nGPU kernel time per 1-row forward (tuned):", json.dumps(prof))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_tiles.json").write_text(json.dumps(dict(
        linear={f"{n},{k}": list(t) for (n, k), t in linear_best.items()}, attention=list(attn_best),
        forward=[before, after], profile_1row=prof, linear_all=linear_all, attention_all=attn_all), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
