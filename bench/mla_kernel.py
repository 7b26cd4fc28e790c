"""Absorbed MLA tree-verify kernel (issue 10) at Kimi-K2 per-rank shapes under TP8, on one GPU.

python3 -m bench.mla_kernel [--out DIR] [--quick] [--sweep] [--layer | --layer-only] [--budget-s S] [--reps N] [--sdpa-reps N]
    [--prefix triton|gluon|auto] [--vs-prefix triton,gluon-ws,gluon-sync]

--prefix picks the committed-prefix launch of the timed call (specdec_kernels/mla_prefix.py's Gluon kernels on Hopper, or
Triton's); --vs-prefix times the same call with other prefix launches at every shape, in the same run, as extra
columns (ms and this call ÷ it). Session 12's table: --prefix gluon --vs-prefix triton,gluon-sync.

Per rank: h = 8 query heads, latent 576 (= 512 + 64 rope) / V 512, bf16, softmax scale 0.1309.
For prefix L ∈ {1k, 4k, 16k, 32k} × tree size n ∈ {8, 32, 64, 256} × batch B ∈ {1, 8, 32}
(B requests, each with its own random tree of n rows over its own L committed latent rows):
- kernel time: CUDA-graph replay (GPU time; eager time with Python launch cost beside it),
  CUDA events, median, L2 flushed before each call; a float64 spot check of a few rows;
- the floors, from rates measured in the same run: memory = bytes ÷ copy bandwidth (bytes =
  every request's L + n latent rows read once + q + out), compute = FLOPs ÷ bf16 matmul rate
  (FLOPs = Σ_rows 2·h·(P_i + 1)·(576 + 512)); time ÷ max(floors);
- batched torch SDPA with a boolean tree mask over the same latent (one KV head, enable_gqa).
Plus bitwise checks (bf16) that every tree row equals a one-row decode after its path is
committed: the kernel alone (L = 4k, n = 32) and a tiny model on the row-invariant path.
Then the GPU time of each of the kernel's three launches at three shapes (profiler).
--sweep: first search the tiling (VARIANTS of vsplit, bn, stages, warps, chunk, then other chunk
sizes for the best; ≤ --sweep-s seconds, five shapes, each variant checked against the float64
reference and for row invariance, and for equal bits where only non-arithmetic knobs differ) and
run everything with the best; --sweep-only: just that, into mla_sweep_h200.md/.json.
--budget-s bounds the whole run (one short device window): table shapes past it are listed as
not run and the tiny-model check is skipped. The goal
(issue 10): ≤ 2× the floor wherever the KV read is ≥ 32 MB, never slower than SDPA. --layer: one full-width Kimi-K2 layer
(random weights, 384 experts top-8, eager torch with the attention in torch or in this kernel)
at tree sizes 8/32/64 vs its weight-read floor. Writes mla_kernel_h200.json and .md to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F

from specdec_kernels.mla_attention import (BLOCK_N, CHUNK, TAIL_STAGES, VSPLIT, default_block_r, make_tiles, mla_attention,
                                   mla_attention_reference)
from modeling.tree import tree_ancestors

H, C, R, SCALE = 8, 512, 64, 0.1309
LS, TREES, BATCHES = (1024, 4096, 16384, 32768), (8, 32, 64, 256), (1, 8, 32)
DEV, DTYPE = "cuda", torch.bfloat16


_FLUSH = None


def cuda_ms(fn, reps: int = 20, flush: bool = True) -> float:
    """Median ms of fn() by CUDA events after 2 warm-ups, the L2 cache flushed (a 256 MB write)
    before each timed call so that a KV of < 60 MB is read from HBM, not L2; fewer reps when one
    call is slow."""
    global _FLUSH
    if flush and _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if flush:
            _FLUSH.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
        if sum(times) > 2000:
            break
    return statistics.median(times)


def graph_ms(fn, reps: int = 20) -> float:
    """Like ``cuda_ms`` but of a CUDA-graph replay of fn (GPU time without Python launch cost:
    the kernel's inputs are device tensors and its grid is fixed, so it captures)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_ms(graph.replay, reps)


def rates() -> tuple[float, float]:
    """(copy bandwidth bytes/s: read + write of a 2 GiB copy, bf16 matmul FLOP/s at 8192³)."""
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * src.nbytes / (cuda_ms(lambda: dst.copy_(src)) / 1e3)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    flops = 2 * 8192 ** 3 / (cuda_ms(lambda: a @ b) / 1e3)
    return bw, flops


def ddtree_like(n: int, g: torch.Generator) -> list[int]:
    """parents of a random tree of n rows, deeper than uniform random parents (a node's parent
    is one of the 4 previous nodes), like best-first draft trees."""
    return [-1] + [max(0, i - 1 - int(torch.randint(0, 4, (1,), generator=g))) for i in range(1, n)]


def problem(L: int, n: int, B: int, g: torch.Generator):
    """B requests with L committed rows + a tree of n rows each in one latent pool."""
    stride = L + n + 16
    kv = torch.randn(B * stride + 1, C + R, device=DEV, dtype=DTYPE)
    depth, anc = tree_ancestors(ddtree_like(n, g))
    depth, anc = torch.from_numpy(depth), torch.from_numpy(anc)
    seqs = [(b * n, n, 1 + b * stride, L) for b in range(B)]
    q = torch.randn(B * n, H, C + R, device=DEV, dtype=DTYPE)
    pos = (L + depth).repeat(B).to(DEV)
    return q, kv, pos, anc.repeat(B, 1).to(DEV), seqs, depth, anc


def sdpa_fn(q, kv, seqs, depth, anc, L, n, B):
    """Batched SDPA over the same latent: q [B, h, n, 576], K = latent [B, 1, L+n, 576],
    V = its first 512, mask [B, 1, n, L+n] (prefix + ancestors)."""
    idx = torch.stack([torch.arange(base, base + L + n) for _, _, base, _ in seqs]).to(DEV)
    k = kv[idx][:, None]                                     # [B, 1, S, 576]
    v = k[..., :C]
    qq = q.view(B, n, H, C + R).transpose(1, 2)
    vis = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        vis[i, anc[i, :int(depth[i]) + 1]] = True
    mask = torch.cat([torch.ones(n, L, dtype=torch.bool), vis], 1).to(DEV)[None, None].expand(B, 1, n, L + n)
    return lambda: F.scaled_dot_product_attention(qq, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)


def spot_check(out, q, kv, pos, anc, seqs) -> float:
    """max |err| / max |ref| over the first and last row of the first and last request."""
    rows = sorted({seqs[0][0], seqs[-1][0] + seqs[-1][1] - 1})
    sub = [(0, 1, base, L) for r in rows for (r0, nn, base, L) in seqs if r0 <= r < r0 + nn]
    errs = []
    for r, s in zip(rows, sub):
        ref = mla_attention_reference(q[r:r + 1], kv, pos[r:r + 1], anc[r:r + 1], [s], SCALE, C)
        errs.append(((out[r].double() - ref[0]).abs().max() / ref.abs().max()).item())
    return max(errs)


def bench_kernel(args, bw, fl, g, kw, rows: list, save, deadline: float = math.inf) -> list[dict]:
    """The shape table into ``rows`` (``save()`` after each shape); shapes after ``deadline``
    (time.time()) are listed as not run."""
    for L in (LS[:2] if args.quick else LS):
        for n in TREES:
            for B in BATCHES:
                r = dict(L=L, n=n, B=B)
                if time.time() > deadline:
                    r["error"] = "not run (time budget)"
                    rows.append(r)
                    continue
                try:
                    q, kv, pos, anc, seqs, depth, a1 = problem(L, n, B, g)
                    maxp = L + n
                    tiles = make_tiles(seqs, kw.get("block_r") or default_block_r(H), DEV)
                    fn = lambda: mla_attention(q, kv, pos, anc, seqs, SCALE, C, max_positions=maxp,  # noqa: E731
                                               tiles=tiles, **kw)
                    out = fn()
                    r["rel_err"] = spot_check(out, q, kv, pos, anc, seqs)
                    r["eager_ms"] = cuda_ms(fn, reps=max(3, args.reps // 4))
                    r["kernel_ms"] = graph_ms(fn, reps=args.reps)
                    for name in args.vs_prefix:  # other committed-prefix launches, same inputs, same run
                        launch, over = vs_launch(name)
                        other = dict(kw, prefix=launch.split("-")[0], **over)
                        call = lambda: mla_attention(q, kv, pos, anc, seqs, SCALE, C,  # noqa: E731
                                                     max_positions=maxp, tiles=tiles, **other)
                        vs = r.setdefault("vs_ms", {})
                        try:  # a launch that does not apply here costs its column, not the row
                            vs[name] = graph_ms(gluon_variant(launch, call), reps=args.reps)
                            # the same bits as the timed call? (expected wherever the arithmetic is the same:
                            # not at another @CHUNK)
                            r.setdefault("vs_same_bits", {})[name] = torch.equal(gluon_variant(launch, call)(), out)
                        except Exception as e:  # noqa: BLE001 (record and go on)
                            vs[name] = f"{type(e).__name__}: {str(e)[:80]}"
                    byts = B * (L + n) * (C + R) * 2 + q.nbytes + out.nbytes
                    flops = sum(2 * H * (int(p) + 1) * (C + R + C) for p in pos.tolist())
                    r["kv_mb"] = B * (L + n) * (C + R) * 2 / 1e6
                    r["floor_mem_ms"], r["floor_flop_ms"] = byts / bw * 1e3, flops / fl * 1e3
                    r["x_floor"] = r["kernel_ms"] / max(r["floor_mem_ms"], r["floor_flop_ms"])
                    r["tflops"] = flops / r["kernel_ms"] / 1e9
                    try:
                        r["sdpa_ms"] = cuda_ms(sdpa_fn(q, kv, seqs, depth, a1, L, n, B), reps=args.sdpa_reps)
                    except Exception as e:  # noqa: BLE001 (record and go on)
                        r["sdpa_ms"] = f"{type(e).__name__}: {str(e)[:80]}"
                    del q, kv, out
                except Exception as e:  # noqa: BLE001
                    r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.empty_cache()
                print(json.dumps(r), flush=True)
                rows.append(r)
                save()
    return rows


VS_PREFIX = ("triton", "gluon", "gluon-ws", "gluon-sync")


def prefix_names(v: str) -> list[str]:
    """--vs-prefix: comma-separated names of VS_PREFIX, each optionally with ``@CHUNK`` (the same
    launch at another chunk length, e.g. ``gluon@1024``: a power of two >= 64) and modifiers of the
    tree-block launch: ``+rows`` / ``+leaders`` (per row / per tile), ``+mM`` (dots of M rows: tail_m),
    ``+wW`` (W warps: tail_warps) and ``+sS`` (S pipelined gathers: tail_stages), e.g.
    ``gluon+rows+m16+w8``, and of the combine launch: ``+crow`` /
    ``+chead`` (a program per row / per row, head and 128 columns); empty items dropped, each once (a
    name is a column of the table)."""
    names = list(dict.fromkeys(x.strip() for x in v.split(",") if x.strip()))
    bad = [x for x in names if vs_launch(x) is None]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown prefix launch(es) {', '.join(bad)}; write "
                                         f"NAME[@CHUNK][+rows|+leaders][+mM][+wW][+sS][+crow|+chead] with NAME one of "
                                         f"{', '.join(VS_PREFIX)}, CHUNK a power of two >= 64, M, W and S powers "
                                         f"of two")
    seen, out = set(), []
    for x in names:  # one column per launch: gluon@1024 and gluon@01024 time the same call
        launch, over = vs_launch(x)
        key = (launch, tuple(sorted(over.items())))
        if key not in seen:
            seen.add(key)
            out.append(x)
    return out


TAIL_KNOBS = {"m": "tail_m", "w": "tail_warps", "s": "tail_stages"}  # --vs-prefix +mM, +wW, +sS


def vs_launch(name: str) -> tuple[str, dict] | None:
    """A --vs-prefix name as (launch, the knobs it overrides); None if it is not one."""
    name, *mods = name.split("+")
    launch, at, chunk = name.partition("@")
    if launch not in VS_PREFIX:
        return None
    over = {}
    for mod in mods:
        num = mod[1:]
        if mod in ("rows", "leaders") and "tail_rows" not in over:
            over["tail_rows"] = mod == "rows"
        elif mod in ("crow", "chead") and "combine_rows" not in over:
            over["combine_rows"] = mod == "crow"
        elif mod[:1] in TAIL_KNOBS and num.isascii() and num.isdigit() and int(num) > 0 \
                and not int(num) & (int(num) - 1) and TAIL_KNOBS[mod[0]] not in over:
            over[TAIL_KNOBS[mod[0]]] = int(num)
        else:
            return None
    if at:
        if not (chunk.isascii() and chunk.isdigit()) or int(chunk) < 64 or int(chunk) & (int(chunk) - 1):
            return None
        over["chunk"] = int(chunk)
    return launch, over


def checkable(kw: dict) -> dict:
    """kw for the checks on other shapes or dtypes (fp32, the tiny model): "gluon" → "auto", so
    that where the Gluon launch does not apply the Triton one runs (same bits) instead of refusing."""
    return dict(kw, prefix="auto") if kw.get("prefix") == "gluon" else kw


def gluon_variant(name: str, fn):
    """fn with specdec_kernels.mla_prefix.WARP_SPECIALIZE set for "gluon-ws" / "gluon-sync" while it runs
    (a CUDA graph captures the kernel chosen then); other names: fn."""
    if name not in ("gluon-ws", "gluon-sync"):
        return fn
    from specdec_kernels import mla_prefix

    def call():
        old, mla_prefix.WARP_SPECIALIZE = mla_prefix.WARP_SPECIALIZE, name == "gluon-ws"
        try:
            return fn()
        finally:
            mla_prefix.WARP_SPECIALIZE = old
    return call


def invariance(g, kw, L: int = 4090, n: int = 32, dtype=None) -> dict:
    """Every tree row bitwise equals a one-row decode after its path is committed (L = 4090:
    nodes deeper than 5 cross the block and chunk boundary at 4096, so the decode folds in its
    prefix launch a block that the tree folds in its tree launch)."""
    dtype = dtype or DTYPE
    q, kv, pos, anc, seqs, depth, a1 = problem(L, n, 1, g)
    q, kv = q.to(dtype), kv.to(dtype)
    out = mla_attention(q, kv, pos, anc, seqs, SCALE, C, **kw)
    base, bad = seqs[0][2], 0
    for i in range(n):
        d = int(depth[i])
        kv2 = kv.clone()
        kv2[base + L:base + L + d + 1] = kv[[base + L + int(j) for j in a1[i, :d + 1]]]
        one = mla_attention(q[i:i + 1], kv2, pos[i:i + 1], torch.zeros(1, 1, dtype=torch.int32, device=DEV),
                            [(0, 1, base, L + d)], SCALE, C, **kw)
        bad += not torch.equal(one[0], out[i])
    return dict(L=L, n=n, rows=n, mismatched=bad, dtype=str(dtype))


def model_invariance(kw: dict | None = None) -> dict:
    """Tiny random Kimi-K2-structured model, bf16, row-invariant path (modeling.deepseek_fast):
    every node of a 31-node tree vs a one-row decode after its path is committed, bitwise; the
    attention kernel with tiling kw (the module's defaults when None)."""
    import functools

    import specdec_kernels.mla_attention as mla

    orig = mla.mla_attention
    if kw:  # modeling.deepseek.KernelAttention looks the kernel up at each call
        kw = checkable(kw)  # the tiny model's heads and latent are not the Gluon launch's
        mla.mla_attention = functools.partial(orig, **kw)
    try:
        return _model_invariance()
    finally:
        mla.mla_attention = orig


def _model_invariance() -> dict:
    import tempfile

    from modeling.deepseek_fast import row_invariant_
    from modeling.deepseek_weights import load_deepseek
    from modeling.llama import causal_mask, tree_mask
    from modeling.tree import visibility
    from scripts.make_tiny_deepseek import save_tiny

    g = torch.Generator().manual_seed(1)
    with tempfile.TemporaryDirectory() as d:
        save_tiny(d, "kimi_k2", "fp8")
        model = row_invariant_(load_deepseek(d, "cuda", torch.bfloat16))
    V, L, n = model.cfg.vocab_size, 300, 31
    prompt = torch.randint(0, V, (L,), generator=g).cuda()
    parents = ddtree_like(n, g)
    tokens = torch.randint(0, V, (n,), generator=g).cuda()
    depths, anc = tree_ancestors(parents)
    with torch.inference_mode():
        cache = model.new_cache(L + n + 1)
        model(prompt, torch.arange(L).cuda(), cache, causal_mask(0, L, "cuda"))
        cache.length = L
        vis = torch.from_numpy(visibility(depths, anc)).cuda()
        tree = model.logits(model(tokens, L + torch.from_numpy(depths).cuda(), cache, tree_mask(L, vis))[0])
        after = cache.kv.clone()
        bad, flips = 0, 0
        for i in range(1, n):
            c = model.new_cache(L + n + 1)
            c.kv.copy_(after)
            c.length = L
            c.commit(torch.tensor(anc[i, :depths[i]].tolist()))
            one = model.logits(model(tokens[i:i + 1], torch.tensor([L + int(depths[i])]).cuda(), c,
                                     causal_mask(c.length, 1, "cuda"))[0])
            bad += not torch.equal(one[0], tree[i])
            flips += int(one[0].argmax() != tree[i].argmax())
    return dict(nodes=n - 1, mismatched=bad, argmax_flips=flips)


SWEEP_SHAPES = [(32768, 8, 1), (1024, 64, 32), (4096, 32, 8), (32768, 64, 8), (16384, 256, 32)]
SWEEP_INV = (1020, 12)  # L, tree size of each variant's bitwise check (deep nodes cross block and chunk 1024)
KNOBS = ("block_r", "bn", "num_warps", "num_stages", "chunk", "tma", "vsplit", "tail_stages", "tail_warps")
ARITH = ("block_r", "bn", "chunk", "vsplit")  # the knobs that set a row's arithmetic
# Session 4's H200 sweep (plans/0007): bn 64, 2 stages, chunk 1024, TMA loads won among the
# one-program tilings; (K·qᵀ)ᵀ at bn 128 and P through memory lost and were removed. Session 7
# added the V split (vsplit 2: two 4-warp programs per tile and chunk, each with half of the V
# columns, 64×64 score MMAs) and bn 32 with one stage under it (110 KB of shared memory: two
# programs per SM); on the H200 both were exact and row-invariant but lost to vsplit 1 at
# every shape but 32768/8/1 (16384/256/32: 11.4 and 12.5 vs 9.97 ms; bench/results/
# mla_kernel_h200.md), so they go last. Not measured yet: pipelined tree-block gathers
# (tail_stages 2), the tree launch on 8 warps under vsplit 2 (0.8 vs 2 KB of spills per thread,
# ptxas offline), chunk 512 under vsplit 2. In order of priority (the budget may stop the list;
# a variant costs 7–9 s on the device, mostly compiling).
VARIANTS = [dict(vsplit=1, bn=64, num_stages=2, tma=True),
            dict(vsplit=1, bn=64, num_stages=2, tma=True, tail_stages=2),
            dict(vsplit=2, bn=64, num_stages=2, tma=True, tail_warps=8),
            dict(vsplit=2, bn=64, num_stages=2, tma=True, chunk=512),
            dict(vsplit=2, bn=64, num_stages=2, tma=True, tail_stages=2),
            dict(vsplit=2, bn=64, num_stages=2, tma=True),
            dict(vsplit=2, bn=32, num_stages=1, tma=True),
            dict(vsplit=2, bn=32, num_stages=3, tma=True)]
CHUNKS = (512, 2048)  # tried for the best variant if time is left
# the sweep and the session-4 comparison are about the Triton launches' tilings: their prefix launch is Triton's
SESSION4 = dict(block_r=None, bn=64, num_warps=None, num_stages=2, chunk=1024, tma=True, vsplit=1, tail_stages=1,
                tail_warps=None, prefix="triton")  # session 4's tiling (its arithmetic)
DEFAULTS = dict(block_r=None, bn=BLOCK_N, num_warps=None, num_stages=2, chunk=CHUNK, tma=True, vsplit=VSPLIT,
                tail_stages=TAIL_STAGES, tail_warps=None, prefix="triton")


def sweep(g, budget_s: float = 110.0, on_row=None) -> tuple[list[dict], dict]:
    """Tiling search within ``budget_s``: the VARIANTS, then the best with the other chunk
    sizes. Each variant is timed at SWEEP_SHAPES (CUDA graph), checked against the float64
    reference (rel. error, first/last rows of 1024/64/32) and for row invariance (bf16, every
    node of a 12-row tree at L = 1000 bitwise == a one-row decode after commit); variants with
    the same arithmetic knobs (ARITH) must give the same bits at 1024/64/32 (``same_bits``).
    Score: geometric mean over the shapes of time ÷ the best time seen for that shape
    (inexact or non-invariant variants never win). on_row(rows) after each variant. Returns
    (all rows, the best knobs)."""
    t0, res = time.time(), []
    probs = {shape: problem(*shape, g) for shape in SWEEP_SHAPES}
    keys = [f"{L}/{n}/{B}" for L, n, B in SWEEP_SHAPES]
    outs = {}  # arithmetic knobs -> output at SWEEP_SHAPES[1]

    def run(kw) -> dict:
        kw = dict(DEFAULTS, **kw)
        r, t1 = dict(kw), time.time()
        try:
            for (L, n, B), (q, kv, pos, anc, seqs, _, _) in probs.items():
                tiles = make_tiles(seqs, kw["block_r"] or default_block_r(H), DEV)
                fn = lambda: mla_attention(q, kv, pos, anc, seqs, SCALE, C, max_positions=L + n,  # noqa: E731
                                           tiles=tiles, **kw)
                if (L, n, B) == SWEEP_SHAPES[1]:
                    out = fn()
                    r["rel_err"] = spot_check(out, q, kv, pos, anc, seqs)
                    arith = tuple(kw[k] for k in ARITH)
                    if arith in outs:
                        r["same_bits"] = bool(torch.equal(outs[arith], out))
                    else:
                        outs[arith] = out
                r[f"{L}/{n}/{B}"] = graph_ms(fn, reps=10)
            inv = invariance(g, kw, *SWEEP_INV)
            r["invariant"] = f"{inv['rows'] - inv['mismatched']}/{inv['rows']}"
            r["ok"] = inv["mismatched"] == 0 and r["rel_err"] < 2e-2 and r.get("same_bits", True)
        except Exception as e:  # noqa: BLE001 (a config that does not compile or fit)
            r["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        r["s"] = round(time.time() - t1, 1)
        print(json.dumps(r), flush=True)
        res.append(r)
        if on_row:
            on_row(res)
        return r

    def score(r) -> float:
        if "error" in r or not r.get("ok"):
            return math.inf
        best = {k: min(x[k] for x in res if "error" not in x) for k in keys}
        return math.exp(sum(math.log(r[k] / best[k]) for k in keys) / len(keys))

    for kw in VARIANTS:
        if time.time() - t0 < budget_s * 0.8:
            run(kw)
    top = sorted((r for r in res if math.isfinite(score(r))), key=score)[:1]
    for r in top:
        for ch in CHUNKS:
            kw = {k: r[k] for k in KNOBS}
            if ch != kw["chunk"] and time.time() - t0 < budget_s * 0.8 and not any(
                    all(x.get(k) == v for k, v in dict(kw, chunk=ch).items()) for x in res):
                run(dict(kw, chunk=ch))
    for r in res:
        r["score"] = score(r)
    best = min(res, key=lambda r: r["score"]) if res else {}
    if not math.isfinite(best.get("score", math.inf)):
        raise RuntimeError("no variant ran exact and row-invariant")
    del probs, outs
    torch.cuda.empty_cache()
    return res, {k: best[k] for k in KNOBS}


SPLIT_SHAPES = ((16384, 256, 32), (4096, 64, 8), (32768, 8, 1))


def split_shapes(v: str) -> tuple:
    """--split-shapes "L/tree/B,...": positive integers, at least one shape."""
    try:
        shapes = tuple(tuple(int(x) for x in item.split("/")) for item in v.split(",") if item.strip())
    except ValueError:
        shapes = ()
    if not shapes or any(len(t) != 3 or min(t) < 1 for t in shapes):
        raise argparse.ArgumentTypeError(f"--split-shapes {v!r}: write L/tree/B[,L/tree/B...] with positive integers")
    return shapes


def profile_events(fn, calls: int = 5):
    """The torch profiler's CUDA events of ``calls`` calls of fn (after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.events()


def launch_split(g, kw, shapes=SPLIT_SHAPES, label: str = "") -> list[dict]:
    """GPU ms of each of the kernel's three launches (prefix chunks, tree blocks, combine) with
    tiling kw, from the torch profiler (median of 5 calls; where the time goes)."""
    res = []
    for L, n, B in shapes:
        q, kv, pos, anc, seqs, _, _ = problem(L, n, B, g)
        fn = lambda: mla_attention(q, kv, pos, anc, seqs, SCALE, C, max_positions=L + n, **kw)  # noqa: E731
        ev = sorted((e for e in profile_events(fn) if e.name.startswith("_mla_") and e.device_time > 0),
                    key=lambda e: e.time_range.start)
        parts = [[e.device_time / 1e3 for e in ev[k::3]] for k in range(3)]
        r = dict(shape=f"{L}/{n}/{B}", kernels=len(ev)) | (dict(tiling=label) if label else {})
        r.update({name: statistics.median(t) for name, t in zip(("prefix_ms", "tree_ms", "combine_ms"), parts) if t})
        print(json.dumps(r), flush=True)
        res.append(r)
        del q, kv
    torch.cuda.empty_cache()
    return res


def kernel_profile(fn, top: int = 25) -> list[tuple[str, float, int]]:
    """GPU time per call of fn by kernel name (torch profiler, 5 calls): the ``top`` largest as
    (name, µs per call, launches per call), then ("(all)", total µs, launches)."""
    with torch.inference_mode():
        events = profile_events(fn)
    per: dict[str, list] = {}
    for e in events:
        if e.device_time > 0:
            v = per.setdefault(e.name[:60], [0.0, 0])
            v[0] += e.device_time / 5
            v[1] += 1
    rows = sorted(((k, round(t, 1), n // 5) for k, (t, n) in per.items()), key=lambda r: -r[1])
    return rows[:top] + [("(all)", round(sum(r[1] for r in rows), 1), sum(r[2] for r in rows))]


def layer_bench(bw, tp8_rank: bool = False) -> list[dict]:
    """One full-width Kimi-K2 decoder layer (MLA + MoE, 384 experts top-8, random bf16
    weights; tp8_rank: one TP8 rank's share — 8 heads, expert and shared-expert slices of 256,
    the replicated q_a / kv_a and router, no all-reduce) over a 4k latent prefix: tree verify forward time vs the floor of reading the
    weights it touches (attention + router + shared expert + the distinct experts chosen).
    First the eager torch layer (cuBLAS linears, per-expert loop; attention in torch or the
    kernel), then the same layer switched to the row-invariant kernels (``row_invariant_modules_``:
    the serving path on a GPU, experts grouped by ``specdec_kernels.moe``), and the MoE alone each way
    (the grouped experts against the per-expert loop of the same row-invariant linears: same bits?)."""
    from modeling.deepseek import DeepseekConfig, DeepseekDecoderLayer, KernelAttention, MLACache, MoE
    from modeling.deepseek_fast import moe_loop, row_invariant_modules_

    cfg = DeepseekConfig.from_dict(dict(
        model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=256 if tp8_rank else 2048, num_hidden_layers=1, first_k_dense_replace=0,
        num_attention_heads=8 if tp8_rank else 64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=384, n_group=1, topk_group=1, num_experts_per_tok=8, n_shared_experts=1,
        routed_scaling_factor=2.827, max_position_embeddings=131072, rope_theta=50000.0,
        rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                          beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)))
    torch.set_default_dtype(torch.bfloat16)  # build in bf16: 384 experts are 34 GB
    try:
        with torch.device("cuda"):
            layer = DeepseekDecoderLayer(cfg, 0)
    finally:
        torch.set_default_dtype(torch.float32)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    layer.requires_grad_(False)
    L, res, cases = 4096, [], []
    g = torch.Generator().manual_seed(0)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, 64, 2, device="cuda").float() / 64)
    for n in (8, 32, 64):
        cache = MLACache(1, L + n, 576, "cuda", torch.bfloat16)
        cache.kv.normal_()
        cache.length = L
        x = torch.randn(n, cfg.hidden_size, generator=g).to("cuda", torch.bfloat16)
        depth, anc = tree_ancestors(ddtree_like(n, g))
        pos = (L + torch.from_numpy(depth)).cuda()
        ang = pos.float()[:, None] * inv[None]
        cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
        vis = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            vis[i, anc[i, :int(depth[i]) + 1]] = True
        mask = torch.cat([torch.ones(n, L, dtype=torch.bool), vis], 1).cuda()
        ka = KernelAttention(pos, mask, L)
        with torch.inference_mode():
            hx = layer.post_attention_layernorm(x)
            ms = cuda_ms(lambda: layer(x, cos, sin, cache, 0, mask), reps=10)
            ms_k = cuda_ms(lambda: layer(x, cos, sin, cache, 0, ka), reps=10)
            attn_k = cuda_ms(lambda: layer.self_attn(x, cos, sin, cache, 0, ka), reps=10)
            moe_torch = cuda_ms(lambda: layer.mlp(hx), reps=10)
            ids, _ = layer.mlp.route(hx)
        experts = ids.unique().numel()
        e_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
        attn_bytes = sum(p.nbytes for p in layer.self_attn.parameters())
        moe_bytes = (experts + 1) * e_bytes + layer.mlp.gate.weight.nbytes
        byts = attn_bytes + moe_bytes + L * 576 * 2
        floor = byts / bw * 1e3
        res.append(dict(width="TP8 rank" if tp8_rank else "full", n=n, L=L, ms_torch_attention=ms, ms_kernel_attention=ms_k, ms_attention_only_kernel=attn_k,
                        ms_moe_torch=moe_torch, distinct_experts=experts, bytes_mb=byts / 1e6, floor_ms=floor,
                        moe_floor_ms=moe_bytes / bw * 1e3, x_floor=ms_k / floor,
                        note="eager torch layer (per-expert loop, cuBLAS linears); attention in torch or the kernel"))
        cases.append((x, cos, sin, cache, ka, hx))
        print(json.dumps(res[-1]), flush=True)
    row_invariant_modules_(layer)  # the GPU serving path: row-invariant kernels, grouped experts
    for r, (x, cos, sin, cache, ka, hx) in zip(res, cases):
        with torch.inference_mode():
            hx = layer.post_attention_layernorm(x)
            r["ms_row_invariant"] = cuda_ms(lambda: layer(x, cos, sin, cache, 0, ka), reps=10)
            try:  # the same forward replayed from a CUDA graph: what the host's Python launches cost
                r["ms_row_invariant_graph"] = graph_ms(lambda: layer(x, cos, sin, cache, 0, ka), reps=10)
            except Exception as e:  # noqa: BLE001 (record and go on)
                r["ms_row_invariant_graph"] = f"{type(e).__name__}: {str(e)[:120]}"
            r["ms_moe_grouped"] = cuda_ms(lambda: layer.mlp(hx), reps=10)
            r["ms_moe_loop_row_invariant"] = cuda_ms(lambda: moe_loop(layer.mlp, hx), reps=3)
            r["moe_same_bits"] = torch.equal(layer.mlp(hx), moe_loop(layer.mlp, hx))
        if tp8_rank and r["n"] == 8:  # where a rank's verify layer spends its GPU time, by kernel
            r["kernels_tree8"] = kernel_profile(lambda: layer(x, cos, sin, cache, 0, ka))
        r["x_floor_row_invariant"] = r["ms_row_invariant"] / r["floor_ms"]
        if isinstance(r["ms_row_invariant_graph"], float):
            r["x_floor_row_invariant_graph"] = r["ms_row_invariant_graph"] / r["floor_ms"]
        print(json.dumps(r), flush=True)
    return res


def vs_cells(r: dict, names) -> str:
    """The '--vs-prefix' cells of a row, by name: ms and kernel ms ÷ it; an error's text; blank if not run."""
    out = ""
    for name in names:
        v = r.get("vs_ms", {}).get(name)
        same = {True: " ≡", False: " ≠"}.get(r.get("vs_same_bits", {}).get(name), "")
        out += (f" {v:.3f}{same} | {r['kernel_ms'] / v:.3f} |" if isinstance(v, (int, float)) else
                f" {v[:60]} | |" if isinstance(v, str) else " | |")
    return out


def markdown(meta, rows, inv) -> str:
    vs = meta.get("vs_prefix") or ()
    out = [f"# MLA tree-verify kernel, {meta['device']}", "",
           f"Kimi-K2 per rank under TP8: h={H}, latent {C}+{R}, bf16, scale {SCALE}. Copy bandwidth "
           f"{meta['copy_gbs']:.0f} GB/s, bf16 matmul {meta['matmul_tflops']:.0f} TFLOP/s (measured in this run). "
           f"Tiling {meta['tiling']}. Bitwise node == one-row decode after commit: "
           f"{inv.get('rows', 0) - inv.get('mismatched', 0)}/{inv.get('rows', 0)} rows (bf16, L {inv.get('L')}), "
           f"fp32: {inv.get('fp32')}; whole row-invariant "
           f"tiny Kimi-K2 model (bf16): {inv.get('model')}.", "",
           "| L | tree | B | KV MB | kernel ms (graph) | eager ms | TFLOP/s | floor mem ms | floor flop ms | × floor "
           "| SDPA ms | rel err |" + "".join(f" {v} prefix ms | ÷ it |" for v in vs),
           "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * len(vs)]
    goal, n_goal, slower = 0, 0, 0
    vs_goal = dict.fromkeys(vs, 0)  # the goal with each --vs-prefix launch's call time instead
    for r in rows:
        if "error" in r:
            out.append(f"| {r['L']} | {r['n']} | {r['B']} | | error: {r['error'][:60]} | | | | | | | |"
                       + " | |" * len(vs))
            continue
        sd = r["sdpa_ms"] if isinstance(r["sdpa_ms"], str) else f"{r['sdpa_ms']:.3f}"
        if r["kv_mb"] >= 32:
            n_goal += 1
            goal += r["x_floor"] <= 2
            floor = max(r["floor_mem_ms"], r["floor_flop_ms"])
            for name in vs:
                v = r.get("vs_ms", {}).get(name)
                vs_goal[name] += isinstance(v, (int, float)) and v <= 2 * floor
        slower += not isinstance(r["sdpa_ms"], str) and r["kernel_ms"] > r["sdpa_ms"]
        out.append(f"| {r['L']} | {r['n']} | {r['B']} | {r['kv_mb']:.1f} | {r['kernel_ms']:.3f} | {r['eager_ms']:.3f} | "
                   f"{r.get('tflops', 0):.0f} | {r['floor_mem_ms']:.3f} | {r['floor_flop_ms']:.3f} | {r['x_floor']:.2f} | "
                   f"{sd} | {r['rel_err']:.1e} |" + vs_cells(r, vs))
    out += ["", f"Goal (≤ 2× floor where KV ≥ 32 MB): met at {goal} of {n_goal} shapes; slower than SDPA at "
            f"{slower} of {len(rows)}."
            + (" With each --vs-prefix launch's call instead: "
               + ", ".join(f"{name} {k} of {n_goal}" for name, k in vs_goal.items()) + "." if vs else "")
            + (" Outputs bitwise equal to the timed call's (≡ in a cell; ≠ where not): "
               + ", ".join(f"{name} at {sum(r.get('vs_same_bits', {}).get(name) is True for r in rows)} of "
                           f"{sum(name in r.get('vs_same_bits', {}) for r in rows)}" for name in vs) + "."
               if any("vs_same_bits" in r for r in rows) else "")]
    return "\n".join(out) + "\n"


def layer_markdown(layer) -> str:
    from specdec_kernels.moe import MOE_SPLIT

    if not isinstance(layer, list):
        return f"\nKimi-K2 layer: {layer}\n"
    out = ["", "Kimi-K2 decoder layer (random bf16 weights, 384 experts top-8, L = 4096, one GPU; full width: 64 heads, "
           "I 2048; TP8 rank: one rank's share, 8 heads, expert slices of 256, no all-reduce): eager "
           "torch layer (cuBLAS, per-expert loop) with torch or kernel attention; the row-invariant layer (the "
           "GPU serving path: Triton kernels, experts grouped by specdec_kernels/moe.py); the MoE alone each way "
           "(grouped ≡ the row-invariant per-expert loop: same bits). Experts' split-K counts (specdec_kernels.moe.MOE_SPLIT, "
           f"(I, H): (gate/up, down)): {MOE_SPLIT or 'none'}.", "",
           "| width | tree | ms (torch attn) | ms (kernel attn) | attn only ms (kernel) | ms row-invariant layer "
           "(eager / CUDA graph) | experts hit | MB read | floor ms | × floor (kernel attn) | × floor (row-invariant: "
           "eager / graph) | MoE ms: torch loop / row-inv. loop / grouped | MoE floor ms | grouped ≡ loop |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in layer:
        ri = r.get("ms_row_invariant", math.nan)
        gr = r.get("ms_row_invariant_graph", math.nan)
        gr_s = f"{gr:.2f}" if isinstance(gr, float) else str(gr)[:60]
        out.append(f"| {r.get('width', 'full')} | {r['n']} | {r['ms_torch_attention']:.2f} | {r['ms_kernel_attention']:.2f} | "
                   f"{r['ms_attention_only_kernel']:.3f} | {ri:.2f} / {gr_s} | {r['distinct_experts']} | "
                   f"{r['bytes_mb']:.0f} | {r['floor_ms']:.3f} | {r['x_floor']:.1f} | "
                   f"{r.get('x_floor_row_invariant', math.nan):.1f} / "
                   f"{r.get('x_floor_row_invariant_graph', math.nan):.1f} | {r.get('ms_moe_torch', math.nan):.2f} / "
                   f"{r.get('ms_moe_loop_row_invariant', math.nan):.2f} / {r.get('ms_moe_grouped', math.nan):.2f} | "
                   f"{r.get('moe_floor_ms', math.nan):.3f} | {r.get('moe_same_bits', '')} |")
    for r in layer:
        if r.get("kernels_tree8"):
            out += ["", f"GPU µs per call by kernel, {r.get('width')} layer at tree {r['n']} (profiler, eager calls): "
                    + "; ".join(f"{name} {us} ({n}×)" for name, us, n in r["kernels_tree8"])]
    return "\n".join(out) + "\n"


def sweep_markdown(res) -> str:
    ok = sorted(res, key=lambda r: r.get("score", math.inf))
    shapes = [f"{L}/{n}/{B}" for L, n, B in SWEEP_SHAPES]
    out = ["", f"Tiling sweep ({len(res)} configs, {sum('error' in r for r in res)} failed to compile or fit; ms per "
           "L/tree/B, CUDA graph; score = geometric mean of time ÷ best per shape; rel err vs float64 at "
           f"{'/'.join(map(str, SWEEP_SHAPES[1]))}; invariant = tree nodes bitwise == one-row decode, "
           f"L {SWEEP_INV[0]}; same bits = equal output to the first variant with the same arithmetic knobs "
           f"{', '.join(ARITH)}):", "",
           "| vsplit | bn | warps (prefix/tree) | stages | tail stages | chunk | tma | " + " | ".join(shapes)
           + " | rel err | invariant | same bits | score |",
           "|---|---|---|---|---|---|---|" + "---|" * len(shapes) + "---|---|---|---|"]
    for r in ok:
        head = (f"| {r.get('vsplit', 1)} | {r['bn']} | {r['num_warps'] or 'auto'}/{r.get('tail_warps') or '='} | "
                f"{r['num_stages']} | "
                f"{r.get('tail_stages', 1)} | {r['chunk']} | {r['tma']} | ")
        if "error" in r:
            out.append(head + f"error: {r['error'][:70]} |" + " |" * (len(shapes) + 3))
            continue
        out.append(head + " | ".join(f"{r[k]:.3f}" for k in shapes)
                   + f" | {r['rel_err']:.1e} | {r['invariant']} | {r.get('same_bits', '')} | "
                   f"{r.get('score', math.nan):.2f} |")
    return "\n".join(out) + "\n"


def use_linear_tiles(path: str) -> None:
    """Apply a bench.kernel_tiles JSON's winners: {"N,K": tiling} into specdec_kernels.matmul.TILE_TABLE (the
    fp32 router's shape, bench.kernel_tiles.ROUTER, is skipped: the router runs specdec_kernels.router since
    session 19)."""
    import specdec_kernels.matmul as mm
    from bench.kernel_tiles import ROUTER

    for key, t in json.loads(pathlib.Path(path).read_text())["linear"].items():
        n, k = map(int, key.split(","))
        if (n, k) != ROUTER:
            mm.TILE_TABLE[(n, k)] = tuple(t)
    print(f"linear tiles from {path}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results")
    p.add_argument("--quick", action="store_true", help="L = 1k, 4k only")
    p.add_argument("--sweep", action="store_true",
                   help="first search the tiling (≤ --sweep-s) and run everything with the best one")
    p.add_argument("--sweep-s", type=float, default=110.0)
    p.add_argument("--sweep-only", action="store_true",
                   help="only the sweep (with its exactness and invariance checks): mla_sweep_h200.md/.json")
    p.add_argument("--budget-s", type=float, default=math.inf,
                   help="whole-run time budget: table shapes past it are listed as not run, the tiny-model "
                        "check is skipped when less than 10 s is left")
    p.add_argument("--reps", type=int, default=20, help="timed kernel calls per shape (median; eager: a quarter)")
    p.add_argument("--sdpa-reps", type=int, default=20, help="timed SDPA calls per shape (median)")
    p.add_argument("--no-fp32", action="store_true", help="skip the fp32 bitwise check (the GPU tests have one)")
    p.add_argument("--layer", action="store_true", help="also one full-width Kimi-K2 layer")
    p.add_argument("--layer-widths", type=lambda v: [w for w in v.split(",") if w in ("full", "tp8")] or ["full"],
                   default=["full", "tp8"], help="--layer-only: full, tp8 (one TP8 rank's share) or both (default)")
    p.add_argument("--layer-only", action="store_true",
                   help="only the whole tiny row-invariant model's check and the full-width Kimi-K2 layer "
                        "(no kernel table)")
    p.add_argument("--split-shapes", type=split_shapes, default=SPLIT_SHAPES,
                   help="L/tree/B,... : the shapes of the per-launch GPU time split (profiler)")
    p.add_argument("--block-r", type=int, default=None)
    p.add_argument("--bn", type=int, default=BLOCK_N)
    p.add_argument("--chunk", type=int, default=CHUNK)
    p.add_argument("--vsplit", type=int, default=VSPLIT)
    p.add_argument("--warps", type=int, default=None, help="default: 8 for vsplit 1, 4 for vsplit 2")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--tail-stages", type=int, default=1)
    p.add_argument("--tail-warps", type=int, default=None)
    p.add_argument("--no-tma", action="store_true", help="prefix blocks by plain loads, not TMA (Hopper)")
    p.add_argument("--prefix", choices=("triton", "gluon", "auto"), default=None,
                   help="the committed-prefix launch (default: specdec_kernels.mla_attention.PREFIX)")
    p.add_argument("--vs-prefix", type=prefix_names, default=[],
                   help="comma-separated prefix launches also timed at every shape (same inputs, same run; columns "
                        "'ms', '÷ it'): triton, gluon, gluon-ws, gluon-sync (the two Gluon kernels), each optionally "
                        "@CHUNK: at that chunk length (e.g. gluon@1024 beside --chunk 2048), and +rows / +leaders: "
                        "the tree-block launch per row / per tile, +mM: its dots of M rows, +wW: W warps, "
                        "+sS: S pipelined gathers; +crow / +chead: "
                        "the combine launch per row / per row, head and 128 columns")
    p.add_argument("--moe-split", default=None,
                   help="comma-separated bench.moe_kernel --split JSONs: each one's best split-K counts into "
                        "specdec_kernels.moe.MOE_SPLIT (layer bench: before they are pasted)")
    p.add_argument("--linear-tiles", default=None,
                   help="a bench.kernel_tiles JSON (its 'linear' winners) applied to specdec_kernels.matmul's table (the "
                        "router's entry skipped: specdec_kernels.router) (layer bench: before they are pasted)")
    a = p.parse_args(argv)
    if a.linear_tiles:
        use_linear_tiles(a.linear_tiles)
    if a.moe_split:
        import specdec_kernels.moe as km
        from bench.moe_kernel import best_split

        for path in a.moe_split.split(","):
            key, counts = best_split(path)
            km.MOE_SPLIT[key] = counts
            print(f"specdec_kernels.moe.MOE_SPLIT[{key}] = {counts} ({path})", flush=True)
    kw = dict(block_r=a.block_r, bn=a.bn, chunk=a.chunk, num_warps=a.warps, num_stages=a.stages, tma=not a.no_tma,
              vsplit=a.vsplit, tail_stages=a.tail_stages, tail_warps=a.tail_warps, prefix=a.prefix)
    t0 = time.time()
    deadline = t0 + a.budget_s
    g = torch.Generator().manual_seed(0)
    if a.sweep_only:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)

        def save_sweep(res, best=None):  # after every variant: a run cut short keeps what it measured
            head = f"# MLA kernel tiling sweep, {torch.cuda.get_device_name()}\n\nBest: {json.dumps(best)}\n"
            (out / "mla_sweep_h200.md").write_text(head + sweep_markdown(res))
            (out / "mla_sweep_h200.json").write_text(json.dumps(dict(best=best, rows=res), indent=1))
            return head + sweep_markdown(res)

        res, best = sweep(g, a.sweep_s, save_sweep)
        print(save_sweep(res, best))
        try:
            split = launch_split(g, best)
        except Exception as e:  # noqa: BLE001 (the profiler is a nice-to-have)
            split = f"{type(e).__name__}: {str(e)[:200]}"
        with open(out / "mla_sweep_h200.md", "a") as f:
            f.write(f"\nLaunch split of the best (ms, profiler): {json.dumps(split)}\n")
        print(f"launch split: {json.dumps(split)}")
        print(f"done in {time.time() - t0:.0f} s")
        return
    bw, fl = rates()
    tuned = None
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.sweep:
        try:
            tuned = sweep(g, a.sweep_s, lambda res: (out / "mla_sweep_partial.json").write_text(json.dumps(res)))
            kw = dict(tuned[1], prefix=a.prefix)  # the sweep's knobs; the launch asked for
        except Exception as e:  # noqa: BLE001 (fall back to the given tiling)
            print(f"sweep failed: {type(e).__name__}: {e}", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), copy_gbs=bw / 1e9, matmul_tflops=fl / 1e12,
                tiling=json.dumps(kw), torch=torch.__version__, reps=a.reps, sdpa_reps=a.sdpa_reps,
                vs_prefix=a.vs_prefix)
    print(json.dumps(meta), flush=True)
    inv, rows = {}, []
    res = dict(meta=meta, invariance=inv, rows=rows)
    if tuned:
        res["sweep"] = tuned[0]

    def save():  # after every step: a run cut short keeps what it measured
        res["seconds"] = time.time() - t0
        (out / "mla_kernel_h200.json").write_text(json.dumps(res, indent=1))
        md = markdown(meta, rows, inv) + (layer_markdown(res["layer"]) if "layer" in res else "")
        if "launch_split" in res:
            md += f"\nGPU ms per launch (prefix chunks, tree blocks, combine; profiler): {json.dumps(res['launch_split'])}\n"
        if tuned:
            md += sweep_markdown(tuned[0])
        (out / "mla_kernel_h200.md").write_text(md)

    if a.layer_only:  # the whole row-invariant tiny model's check, then the full-width layer
        for name, fn in (("model", lambda: model_invariance(kw)),
                         ("layer", lambda: sum((layer_bench(bw, tp8_rank=w == "tp8") for w in a.layer_widths), []))):
            try:
                (inv if name == "model" else res)[name] = fn()
            except Exception as e:  # noqa: BLE001 (keep what was measured)
                (inv if name == "model" else res)[name] = f"{type(e).__name__}: {str(e)[:300]}"
            print(json.dumps(inv), flush=True)
            save()
        print(f"done in {res['seconds']:.0f} s")
        return
    inv.update(invariance(g, kw))
    print(json.dumps(inv), flush=True)
    try:  # the checks first: a run cut short loses timings, not evidence of exactness
        # fp32 tiles are twice the bytes: bn 32, one stage fits in shared memory at C = 512
        inv["fp32"] = ("not run (--no-fp32)" if a.no_fp32 else
                       invariance(g, checkable(dict(kw, bn=32, num_stages=1)), L=1020, n=24, dtype=torch.float32))
    except Exception as e:  # noqa: BLE001 (record and go on)
        inv["fp32"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(json.dumps(inv), flush=True)
    save()
    bench_kernel(a, bw, fl, g, kw, rows, save, deadline - 4)
    print(markdown(meta, rows, inv), flush=True)
    try:
        res["launch_split"] = launch_split(g, kw, a.split_shapes)
        if any(kw.get(k) != SESSION4[k] for k in KNOBS):  # where the time goes vs the session-4 default
            res["launch_split"] += launch_split(g, SESSION4, ((32768, 8, 1), (4096, 64, 8)), "session 4")
    except Exception as e:  # noqa: BLE001 (the profiler is a nice-to-have)
        res["launch_split"] = f"{type(e).__name__}: {str(e)[:200]}"
    save()
    if time.time() < deadline - 10:
        try:
            inv["model"] = model_invariance(kw)
        except Exception as e:  # noqa: BLE001 (record and go on)
            inv["model"] = f"{type(e).__name__}: {str(e)[:300]}"
    else:
        inv["model"] = "not run (time budget)"
    print(json.dumps(inv), flush=True)
    save()
    for flag, name, fn in [(a.layer, "layer", lambda: layer_bench(bw))]:
        if flag:
            try:
                res[name] = fn()
            except Exception as e:  # noqa: BLE001 (keep what was measured)
                res[name] = f"{type(e).__name__}: {str(e)[:300]}"
                print(res[name], flush=True)
            torch.cuda.empty_cache()
            save()
    print(f"done in {res['seconds']:.0f} s")


if __name__ == "__main__":
    main()
