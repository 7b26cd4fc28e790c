"""Grouped MoE experts (specdec_kernels/moe.py) at Kimi-K2's width on one GPU: 384 experts,
H 7168, I 2048 (full width; --inter 256: one rank's slices under TP8), top-8, bf16 random weights; T = 8, 32, 64, 256 tokens with uniformly random
distinct experts per token. Time (CUDA graph) vs the floor of reading the distinct experts'
weights once at measured copy bandwidth, for several tilings (the first is the default; the
others' outputs compared bit for bit with it), and the GPU time per launch of the default
(profiler). Prints a table, writes moe_kernel_h200.{md,json}.

python3 -m bench.moe_kernel [--out bench/results] [--reps 20] [--inter 2048] [--tag TAG] [--sweep | --split | --sort] [--fp8]

--sweep: instead of the named variants, each projection's tiling alone over BN × BK × stages (the
other projection at the default), one row per candidate (moe_sweep_h200{TAG}.md).
--split: likewise over BN × split-K count (BK 128: the counts ``specdec_kernels.moe.MOE_SPLIT`` takes; a split
changes the bits, ≠, as for ``specdec_kernels.matmul``'s split-K: partials summed in a fixed order).
--sort: only the expert sort and tile table (``specdec_kernels.moe.expert_tiles``) at 64–4096 (token, expert) pairs: the
torch ops vs the one-launch kernel at 4, 8 and 16 warps, each checked equal to the torch ops
(moe_sort_h200{TAG}.md).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from bench.mla_kernel import graph_ms

E, H, K = 384, 7168, 8
# (gate/up tiling, down tiling) as specdec_kernels.matmul Tiles (BM ignored); the default is specdec_kernels.moe.MOE_TILES;
# BN, warps and stages do not change a bit (nor, measured on the H200, BK)
VARIANTS = {
    "default": None,
    "bn128": ((64, 128, 128, 4, 3), (64, 128, 128, 4, 3)),
    "stages4": ((64, 64, 128, 4, 4), (64, 64, 128, 4, 4)),
    "bn32": ((64, 32, 128, 4, 4), (64, 32, 128, 4, 4)),
    "bn16-s5": ((64, 16, 128, 4, 5), (64, 16, 128, 4, 5)),
    "bk256": ((64, 64, 256, 4, 3), (64, 64, 256, 4, 3)),
    "bn32-bk256": ((64, 32, 256, 4, 3), (64, 32, 256, 4, 3)),
}


def sweep_variants() -> dict:
    """Each projection's (BN, BK, stages) alone, the other at specdec_kernels.moe.MOE_TILES."""
    from specdec_kernels.moe import BLOCK_M, MOE_TILES

    base13, base2 = ((BLOCK_M, *t) for t in MOE_TILES)
    out = {"default": None}
    for bn in (16, 32, 64, 128):
        for bk in (128, 256):
            for st in (3, 5):
                t = (BLOCK_M, bn, bk, 4, st)
                out[f"gate_up {bn},{bk},4,{st}"] = (t, base2)
                out[f"down {bn},{bk},4,{st}"] = (base13, t)
    return out


def split_variants(inter: int) -> dict:
    """Each projection over BN × split-K count (whole 128-wide K blocks per run), the other at the default."""
    from specdec_kernels.moe import BLOCK_M, moe_tiles

    base13, base2 = moe_tiles(inter, H)
    out = {"default": None}
    for bn in (32, 64, 128):
        for s in (1, 2, 4, 7, 14):
            out[f"gate_up bn {bn} split {s}"] = ((BLOCK_M, bn, 128, 4, 3, s), base2)
    for bn in (64, 128, 256):
        for s in (1, 2, 4, 8, 16):
            if s <= -(-inter // 128):
                out[f"down bn {bn} split {s}"] = (base13, (BLOCK_M, bn, 128, 4, 3, s))
    return out


def best_split(path: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """From a ``--split`` run's JSON: ((I, H), (gate/up count, down count)) — per projection the split
    count whose variant at ``specdec_kernels.moe.MOE_TILES``'s BN has the least mean over T of its time ÷ the
    default's (every T alike: a count is fixed per weight shape, whatever the rows)."""
    from specdec_kernels.moe import MOE_TILES

    payload = json.loads(pathlib.Path(path).read_text())
    rows = payload["rows"]
    best = []
    for proj, bn in (("gate_up", MOE_TILES[0][0]), ("down", MOE_TILES[1][0])):
        score = {}
        for name in rows[0]["ms"]:
            parts = name.split()
            if parts[0] == proj and int(parts[2]) == bn and all(isinstance(r["ms"].get(name), float) for r in rows):
                score[int(parts[4])] = sum(r["ms"][name] / r["ms"]["default"] for r in rows) / len(rows)
        best.append(min(score, key=score.get) if score else 1)
    return (payload["inter"], H), tuple(best)


def copy_bw() -> float:
    a = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - t)


def launch_split(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        if getattr(ev, "self_device_time_total", 0) > 0:
            key = ("gate_up" if "_gate_up_kernel" in ev.key else "down" if "_down_kernel" in ev.key
                   else "weighted_sum" if "_weighted_sum" in ev.key else "split sum" if "_split_sum" in ev.key
                   else "swiglu" if "_swiglu" in ev.key else "sort/tiles (torch)")
            out[key] = out.get(key, 0.0) + ev.self_device_time_total / 1e3
    return {k: round(v, 4) for k, v in out.items()}


def sort_bench(a) -> None:
    """``--sort``: µs per call (CUDA graph) of the expert sort, torch ops vs one launch."""
    from specdec_kernels.moe import expert_tiles_one_launch, expert_tiles_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    warps = (4, 8, 16)
    md = ["# Expert sort and tile table (specdec_kernels.moe.expert_tiles), " + torch.cuda.get_device_name(), "",
          f"{E} experts, top-{K}, uniformly random distinct experts per token; µs per call (CUDA graph, median); "
          "= : every output equal to the torch ops'.", "",
          "| tokens | pairs | torch ops µs | " + " | ".join(f"one launch, {w} warps µs" for w in warps) + " |",
          "|---|---|---|" + "---|" * len(warps)]
    rows = []
    for T in (8, 32, 64, 128, 256, 512):
        ids = torch.rand(T, E, device="cuda", generator=g).topk(K, -1).indices
        w = torch.rand(T, K, device="cuda", generator=g)
        ref = expert_tiles_reference(ids, E)
        r = dict(T=T, pairs=T * K, torch_us=graph_ms(lambda: expert_tiles_reference(ids, E), a.reps) * 1e3,
                 one_us={}, equal={})
        for nw in warps:
            try:
                out = expert_tiles_one_launch(ids, E, weights=w, num_warps=nw)
                used = ref[1][:, 2] > 0
                r["equal"][nw] = bool(torch.equal(out[0], ref[0]) and torch.equal(out[1][used], ref[1][used])
                                      and torch.equal(out[1][:, 2] > 0, used) and torch.equal(out[2], ref[2])
                                      and torch.equal(out[3], ref[3]))
                r["one_us"][nw] = graph_ms(lambda: expert_tiles_one_launch(ids, E, weights=w, num_warps=nw),
                                           a.reps) * 1e3
            except Exception as e:  # noqa: BLE001 (record and go on)
                r["one_us"][nw] = f"{type(e).__name__}: {str(e)[:60]}"
        rows.append(r)
        print(json.dumps(r), flush=True)
        cells = [f"{v:.1f} {'=' if r['equal'][nw] else '≠'}" if isinstance(v := r["one_us"][nw], float) else v
                 for nw in warps]
        md.append(f"| {T} | {T * K} | {r['torch_us']:.1f} | " + " | ".join(cells) + " |")
    write(a, "moe_sort_h200", "\n".join(md) + "\n", dict(rows=rows))


def main(argv=None) -> None:
    from specdec_kernels.moe import moe_experts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--inter", type=int, default=2048, help="expert intermediate size (256: a TP8 rank's slice)")
    p.add_argument("--tag", default="", help="suffix of the output files' names")
    p.add_argument("--sweep", action="store_true", help="each projection's tiling over BN × BK × stages")
    p.add_argument("--split", action="store_true", help="each projection over BN × split-K count")
    p.add_argument("--fp8", action="store_true", help="expert weights kept in FP8 e4m3 with 128×128 block scales")
    p.add_argument("--sort", action="store_true", help="only the expert sort: torch ops vs one launch")
    a = p.parse_args(argv)
    if a.sort:
        return sort_bench(a)
    variants = sweep_variants() if a.sweep else split_variants(a.inter) if a.split else VARIANTS
    INTER = a.inter
    bw = copy_bw()
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    w2 = torch.randn(E, H, INTER, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    fp8 = {}
    if a.fp8:  # e4m3 bytes of weights ×50 and 0.02 / 50 scales (the values only need to be finite)
        w13, w2 = (w13 * 50).to(torch.float8_e4m3fn), (w2 * 50).to(torch.float8_e4m3fn)
        fp8 = dict(scales=(torch.full((E, 2 * -(-INTER // 128), H // 128), 4e-4, device="cuda"),
                           torch.full((E, H // 128, -(-INTER // 128)), 4e-4, device="cuda")))
    rows = []
    for T in (8, 32, 64, 256):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(T, E, device="cuda", generator=g).topk(K, -1).indices
        w = torch.rand(T, K, device="cuda", generator=g)
        experts = ids.unique().numel()
        floor = experts * 3 * H * INTER * (1 if a.fp8 else 2) / bw * 1e3
        r = dict(T=T, experts=experts, floor_ms=floor, ms={}, same_bits={})
        ref = moe_experts(x, w13, w2, ids, w, **fp8)
        for name, tiles in variants.items():
            try:
                fn = lambda: moe_experts(x, w13, w2, ids, w, tiles=tiles, **fp8)  # noqa: E731
                r["ms"][name] = graph_ms(fn, a.reps)
                r["same_bits"][name] = torch.equal(fn(), ref)
            except Exception as e:  # noqa: BLE001 (record and go on)
                r["ms"][name] = f"{type(e).__name__}: {str(e)[:80]}"
        try:
            if a.sweep or a.split:
                raise RuntimeError("not profiled in a sweep")
            r["split_ms"] = launch_split(lambda: moe_experts(x, w13, w2, ids, w, **fp8))
        except Exception as e:  # noqa: BLE001 (the profiler is a nice-to-have)
            r["split_ms"] = f"{type(e).__name__}: {str(e)[:80]}"
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.sweep or a.split:
        return write_sweep(a, bw, INTER, variants, rows)
    names = list(VARIANTS)
    md = ["# Grouped MoE experts (specdec_kernels/moe.py), " + torch.cuda.get_device_name(), "",
          f"Kimi-K2 on one GPU: {E} experts, H {H}, I {INTER}, top-{K}, bf16 activations, "
          f"{'FP8 e4m3 expert weights (128×128 block scales)' if a.fp8 else 'bf16 weights'}; uniformly random distinct "
          f"experts per token; copy bandwidth {bw / 1e9:.0f} GB/s; floor = the distinct experts' weights read once. "
          "ms: CUDA graph, median; ≡: output bitwise equal to the default tiling's.", "",
          "| T | experts | floor ms | " + " | ".join(f"{n} ms | × floor" for n in names) + " | GPU ms per launch (default) |",
          "|---|---|---|" + "---|---|" * len(names) + "---|"]
    for r in rows:
        cells = []
        for n in names:
            v = r["ms"].get(n)
            if isinstance(v, float):
                cells.append(f"{v:.3f}{' ≡' if r['same_bits'].get(n) else ' ≠'} | {v / r['floor_ms']:.2f}")
            else:
                cells.append(f"{v} | ")
        md.append(f"| {r['T']} | {r['experts']} | {r['floor_ms']:.3f} | " + " | ".join(cells)
                  + f" | {json.dumps(r['split_ms'])} |")
    write(a, "moe_kernel_h200", "\n".join(md) + "\n", dict(copy_gbs=bw / 1e9, inter=INTER, rows=rows))


def write_sweep(a, bw, inter, variants, rows) -> None:
    """One row per candidate: ms (≡ / ≠ the default's bits) at each T and the sum over T ÷ the default's."""
    head = ["# Grouped MoE experts: tiling sweep, " + torch.cuda.get_device_name(), "",
            f"{E} experts, H {H}, I {inter}, top-{K}, bf16, copy bandwidth {bw / 1e9:.0f} GB/s; each projection's "
            "(BN, BK, warps, stages) with the other at the default; ms per call (CUDA graph, median); sum ÷ default "
            "= Σ_T ms ÷ the default's.", "",
            "| variant | " + " | ".join(f"T={r['T']} ms" for r in rows) + " | sum ÷ default |",
            "|---|" + "---|" * len(rows) + "---|"]
    base = sum(r["ms"]["default"] for r in rows)
    lines = []
    for name in variants:
        ms = [r["ms"].get(name) for r in rows]
        if not all(isinstance(v, float) for v in ms):
            lines.append((9e9, f"| {name} | " + " | ".join(str(v)[:40] for v in ms) + " | — |"))
            continue
        cells = [f"{v:.3f}{' ≡' if r['same_bits'].get(name) else ' ≠'}" for v, r in zip(ms, rows)]
        lines.append((sum(ms) / base, f"| {name} | " + " | ".join(cells) + f" | {sum(ms) / base:.3f} |"))
    write(a, "moe_sweep_h200", "\n".join(head + [ln for _, ln in sorted(lines)]) + "\n",
          dict(copy_gbs=bw / 1e9, inter=inter, rows=rows))


def write(a, stem: str, text: str, payload: dict) -> None:
    """Print the table; write STEM{--tag}.md and .json under --out."""
    print(text)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}{a.tag}.md").write_text(text)
    (out / f"{stem}{a.tag}.json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
