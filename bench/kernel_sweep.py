"""Tile sweep for the row-invariant verify forward (issue 8), no weights needed.

python -m bench.kernel_sweep [--out DIR]

For each candidate matmul tile config (a subprocess per config: the config is fixed at
import, never per call), builds a random-weight model of the embedded target's shape
(SmolLM2-135M: 30 layers, hidden 576, 9/3 heads, vocab 49152) in bf16 on the GPU, captures
the verify graphs and times one replay per tree size (prefix 300, CUDA events, median of
20). Prints a table and writes kernel_sweep.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

CONFIGS = ["32,64,64,4,3", "16,64,128,4,3", "32,64,128,4,3", "64,64,64,4,3", "64,64,128,4,3", "32,32,128,4,4"]
ROWS = (1, 17, 65, 257, 513)


def one_config() -> dict:
    import numpy as np
    import torch

    from bench.gpu_fast_path import cuda_ms
    from modeling.config import LlamaConfig
    from modeling.fast_forward import RowInvariantLlama
    from modeling.graphs import VerifyGraphs
    from modeling.kv_cache import KVPool
    from modeling.llama import LlamaModel
    from modeling.tree import tree_ancestors

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0)
    torch.manual_seed(0)
    model = LlamaModel(cfg).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    pool = KVPool(cfg.num_hidden_layers, 4096, cfg.num_key_value_heads, cfg.head_dim, "cuda", torch.bfloat16)
    pool.k.normal_(), pool.v.normal_()
    graphs = VerifyGraphs(RowInvariantLlama(model, pool, (1, 14, 27)), 513, torch.device("cuda"))
    graphs.capture()
    out = dict(capture_s=round(graphs.capture_seconds, 2))
    rng = np.random.default_rng(0)
    for n in ROWS:
        parents = [-1] + [int(rng.integers(max(0, i - 8), i)) for i in range(1, n)]
        depths, anc = tree_ancestors(parents)
        args = (rng.integers(0, 49152, n).tolist(), depths, anc, 1, 300)
        with torch.inference_mode():
            out[n] = round(cuda_ms(lambda: graphs(*args)), 3)
    return out


def main(argv=None) -> int:
    if os.environ.get("SWEEP_CHILD"):
        print(json.dumps(one_config()))
        return 0
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    rows = []
    for c in CONFIGS:
        env = dict(os.environ, SWEEP_CHILD="1", SPECDEC_MATMUL_TILES=c)
        p = subprocess.run([sys.executable, "-m", "bench.kernel_sweep"], env=env, capture_output=True, text=True)
        res = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else dict(error=p.stderr[-400:])
        rows.append(dict(tiles=c, **res))
        print(json.dumps(rows[-1]), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_sweep.json").write_text(json.dumps(rows, indent=1))
    print("| tiles BM,BN,BK,warps,stages | " + " | ".join(f"{n} rows ms" for n in ROWS) + " |")
    print("|---" * (len(ROWS) + 1) + "|")
    for r in rows:
        print(f"| {r['tiles']} | " + " | ".join(str(r.get(str(n), r.get(n, 'err'))) for n in ROWS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
