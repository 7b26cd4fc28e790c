"""Where a verify forward's time goes, and which fusion of RMSNorm / SwiGLU into the matmuls
pays (issue 8). No weights needed: a random-weight model of the embedded target's shape.

python -m bench.verify_variants [--out DIR]

Variants of the row-invariant forward (same kernels otherwise, CUDA-graph replay, prefix 300):
  prologue   RMSNorm fused as a matmul prologue (x · w_norm scaled in the K loop; today's code)
  separate   RMSNorm as its own row kernel before each matmul
  folded     norm weight folded into the matmul weight; the matmul sums x² and scales at the end
  *+glu      SwiGLU fused into the down projection's K loop (no separate swiglu launch)
Then a per-kernel GPU-time profile (torch.profiler, eager launches) of the fastest variant.
Prints tables and writes verify_variants.json.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib

ROWS = (1, 17, 65, 257, 513)


def build():
    import torch

    from modeling.config import LlamaConfig
    from modeling.fast_forward import RowInvariantLlama
    from modeling.kv_cache import KVPool
    from modeling.llama import LlamaModel

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0)
    torch.manual_seed(0)
    model = LlamaModel(cfg).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    for p in model.parameters():
        p.normal_(0, 0.02)
    pool = KVPool(cfg.num_hidden_layers, 4096, cfg.num_key_value_heads, cfg.head_dim, "cuda", torch.bfloat16)
    pool.k.normal_(), pool.v.normal_()
    return RowInvariantLlama(model, pool, (1, 14, 27))


def variant_forward(m, norm: str, glu: bool):
    """A forward with RowInvariantLlama's signature for one variant."""
    import torch

    from kernels.matmul import linear
    from kernels.rmsnorm_rows import rmsnorm
    from kernels.rope import rope_qkv
    from kernels.swiglu import swiglu
    from kernels.tree_attention import tree_attention

    c = m.cfg
    h, g, eps = c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps
    folded = [dict(wqkv=(w["wqkv"] * w["ln1"]).contiguous(), wgu=(w["wgu"] * w["ln2"]).contiguous()) for w in m.layers]
    head = (m.lm_head * m.norm).contiguous()

    def normed_linear(x, wn, w, wf, **kw):
        if norm == "prologue":
            return linear(x, w, norm_weight=wn, eps=eps, **kw)
        if norm == "separate":
            return linear(rmsnorm(x, wn, eps), w, **kw)
        return linear(x, wf, rstd=True, eps=eps, **kw)

    def forward(tokens, positions, slots, ancestors, meta):
        x = m.embed[tokens]
        tapped = []
        for i, w in enumerate(m.layers):
            kp, vp = m.pool.k[i], m.pool.v[i]
            qkv = normed_linear(x, w["ln1"], w["wqkv"], folded[i]["wqkv"])
            q = rope_qkv(qkv, positions, m.freqs, slots, kp, vp, h, g)
            attn = tree_attention(q, kp, vp, positions, ancestors, meta)
            x = linear(attn, w["wo"], residual=x)
            gu = normed_linear(x, w["ln2"], w["wgu"], folded[i]["wgu"])
            x = linear(gu, w["wdown"], residual=x, glu=True) if glu else linear(swiglu(gu), w["wdown"], residual=x)
            if i in m.taps:
                tapped.append(x)
        logits = normed_linear(x, m.norm, m.lm_head, head, out_dtype=torch.float32)
        return logits, torch.cat(tapped, -1)

    return forward


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    from bench.gpu_fast_path import cuda_ms
    from modeling.graphs import VerifyGraphs
    from modeling.tree import tree_ancestors

    m = build()
    rng = np.random.default_rng(0)
    trees = {}
    for n in ROWS:
        parents = [-1] + [int(rng.integers(max(0, i - 8), i)) for i in range(1, n)]
        depths, anc = tree_ancestors(parents)
        trees[n] = (rng.integers(0, 49152, n).tolist(), depths, anc, 1, 300)
    results = {}
    ref = None
    for name, norm, glu in [("prologue", "prologue", False), ("separate", "separate", False),
                            ("folded", "folded", False), ("separate+glu", "separate", True),
                            ("folded+glu", "folded", True)]:
        graphs = VerifyGraphs(variant_forward(m, norm, glu), 513, torch.device("cuda"))
        graphs.capture()
        row = dict(capture_s=round(graphs.capture_seconds, 2))
        with torch.inference_mode():
            for n in ROWS:
                row[n] = round(cuda_ms(lambda: graphs(*trees[n])), 3)
            lg, _ = graphs(*trees[65])
            one, _ = graphs(*[trees[65][0][:1], trees[65][1][:1], trees[65][2][:1, :1], 1, 300])
            row["row0_invariant"] = bool(torch.equal(one[0], lg[0]))
            lg = lg.float().clone()
            ref = lg if ref is None else ref
            row["max_dlogit_vs_prologue"] = float((lg - ref).abs().max())
        results[name] = row
        del graphs
        torch.cuda.empty_cache()
    print("| variant | capture s | " + " | ".join(f"{n} rows ms" for n in ROWS) + " | row-invariant | max Δlogit |")
    print("|---|---|" + "---|" * len(ROWS) + "---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['capture_s']} | " + " | ".join(str(r[n]) for n in ROWS)
              + f" | {r['row0_invariant']} | {r['max_dlogit_vs_prologue']:.3g} |")

    best = min(results, key=lambda k: results[k][65])
    norm, glu = best.split("+")[0], best.endswith("glu")
    fwd = variant_forward(m, norm, glu)
    from modeling.graphs import TreeInputs
    inputs = TreeInputs(513, torch.device("cuda"))
    prof_rows = {}
    for n in (1, 65, 513):
        inputs.load(*trees[n], n)
        with torch.inference_mode():
            for _ in range(3):
                fwd(*inputs.views(n))
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fwd(*inputs.views(n))
                torch.cuda.synchronize()
        per = collections.defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name[:60]][0] += e.device_time_total / 5 / 1000
                per[e.name[:60]][1] += 1
        prof_rows[n] = {k: (round(v[0], 4), v[1] // 5) for k, v in sorted(per.items(), key=lambda kv: -kv[1][0])}
        total = sum(v[0] for v in prof_rows[n].values())
        print(f"\n### {best}: GPU kernel time per forward at {n} rows: {total:.3f} ms")
        print("| kernel | ms | launches |\n|---|---|---|")
        for k, (ms, cnt) in list(prof_rows[n].items())[:14]:
            print(f"| {k} | {ms} | {cnt} |")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verify_variants.json").write_text(json.dumps(dict(variants=results, profile=prof_rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
