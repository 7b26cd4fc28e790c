"""MoE router logits ``x @ w.T`` in float32 for few rows, row-invariant, on CUDA cores.

A DeepSeek-V3 / Kimi-K2 router (N = 256–384 experts, K = 7168) stays float32 so that expert
selection does not depend on the compute dtype (``modeling.deepseek.MoE.router_logits``). Through
``specdec_kernels.matmul.linear`` that is an IEEE-fp32 ``tl.dot`` (FMA units, 16-row tiles: 39 µs at 8
rows and 92 µs at 64 on the H200 for ~11 MB of weights, a 2.6-µs read; here 16 and 29 µs). Here each program owns
``BR`` rows × ``BN`` experts over the whole K: per K block it adds the elementwise products
x[r, k]·w[n, k] into a [BR, BN, BK] float32 accumulator (one product-add per element, so each
(r, n, k-lane) sum is the same sequence of operations whatever the lane's row or expert), and
after the K loop one ``tl.sum`` over the BK lanes gives the logit. BR, BN and BK are constants,
never a function of M, so a row's bits are the same in a one-row decode and in a 65-row tree
verify (a row's place inside its block does not change its arithmetic: the layout's K mapping is
the same for every (r, n)). x is read in its own dtype (bf16 hidden states) and widened exactly.
With a split-K count S > 1, program s folds the s-th run of whole BK blocks (``specdec_kernels.matmul.split_k``)
and ``specdec_kernels.matmul.split_sum`` adds the S partials in order: more programs in flight, the same
fixed arithmetic for every M.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from specdec_kernels.matmul import split_k, split_sum

# (BR rows, BN experts per program, BK K positions per step, warps, pipeline stages, split-K count S):
# BR, BN, BK and S fix the arithmetic (one setting per deployment); SPECDEC_ROUTER_BLOCKS="BR,BN,BK,W,ST,S"
# forces another (sweeps: bench/router_kernel.py)
# H200 (bench/results/router_kernel_h200_s19.md, Kimi-K2's 384 × 7168): 15.6 / 17.4 / 28.6 µs at 8 / 32 / 64 rows
# against 38.6 / 69.2 / 92.0 through linear; 3 stages halve the unpipelined loop's time, split-K does not pay
BLOCKS = (8, 4, 256, 4, 3, 1)
_FORCED = os.environ.get("SPECDEC_ROUTER_BLOCKS")


@triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M
def _router_kernel(x_ptr, w_ptr, o_ptr, M, N, K, KS, sxm, swn, som,
                   BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
                   PARTIAL: tl.constexpr):
    rm = tl.program_id(0) * BR + tl.arange(0, BR)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.program_id(2)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BR, BN, BK), dtype=tl.float32)
    for k0 in tl.range(s * KS, tl.minimum(K, (s + 1) * KS), BK, num_stages=STAGES):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None] * swn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                    other=0.0)
        acc += x[:, None, :] * w[None, :, :]
    out = tl.sum(acc, 2)
    omask = (rm[:, None] < M) & (rn[None, :] < N)
    if PARTIAL:
        tl.store(o_ptr + s.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :], out, mask=omask)
    else:
        tl.store(o_ptr + rm[:, None] * som + rn[None, :], out, mask=omask)


def router_logits(x: torch.Tensor, w: torch.Tensor, blocks: tuple[int, ...] | None = None) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32), w [N, K] float32 (row-major) → logits [M, N] float32,
    each the float32 sum of float32 products (x widened exactly). blocks: ``BLOCKS`` (or the
    forced setting) unless given (sweeps and tests: a deployment keeps one). Raises ValueError on
    a shape mismatch, an x dtype other than those three, a non-float32 weight or bad blocks."""
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != torch.float32 \
            or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"router_logits: x {tuple(x.shape)} {x.dtype} (need [M, K] bf16, fp16 or fp32), w "
                         f"{tuple(w.shape)} {w.dtype} (need [N, {x.shape[-1]}] float32)")
    M, K = x.shape
    N = w.shape[0]
    if blocks is None:
        blocks = tuple(int(v) for v in _FORCED.split(",")) if _FORCED else BLOCKS
    blocks = tuple(blocks)
    if len(blocks) != 6 or any(type(v) is not int or v < 1 for v in blocks) \
            or any(v & (v - 1) for v in blocks[:4]):
        raise ValueError(f"router_logits: blocks {blocks} must be (BR, BN, BK, warps, stages, S): ints >= 1, "
                         "the first four powers of two")
    br, bn, bk, warps, stages, split = blocks
    x = x.contiguous()
    w = w.contiguous()
    out = torch.empty(M, N, device=x.device, dtype=torch.float32)
    ks, split = split_k(K, bk, split)
    part = torch.empty(split, M, N, device=x.device, dtype=torch.float32) if split > 1 else out
    _router_kernel[(triton.cdiv(M, br), triton.cdiv(N, bn), split)](
        x, w, part, M, N, K, ks, x.stride(0), w.stride(0), out.stride(0), BR=br, BN=bn, BK=bk, STAGES=stages,
        PARTIAL=split > 1, num_warps=warps)
    if split > 1:
        split_sum(part, out)
    return out


def router_logits_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 reference of ``router_logits``."""
    return x.double() @ w.double().T


@triton.jit
def _select_kernel(lg_ptr, b_ptr, ids_ptr, w_ptr, scale, E: tl.constexpr, G: tl.constexpr, TOPG: tl.constexpr,
                   KTOP: tl.constexpr, NORM: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr, BK: tl.constexpr):
    """Program t: row t's sigmoid scores, the biased choice, the group limit (TOPG of G groups by
    the sum of each group's top two), the top KTOP experts by repeated max (ties: the lower id)
    and their weights. Stores ids [T, KTOP] int64 in descending choice and weights [T, KTOP] fp32:
    always KTOP distinct ids below E (NaN scores rank below every number)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    ok = e < E
    s = tl.sigmoid(tl.load(lg_ptr + t * E + e, mask=ok, other=0.0))
    c = s + tl.load(b_ptr + e, mask=ok, other=0.0)
    c = tl.where(ok & (c == c), c, float("-inf"))  # (a NaN score ranks last, never out of range)
    if TOPG < G:
        EG: tl.constexpr = E // G
        grp = e // EG
        gi = tl.arange(0, BG)
        gs = tl.full((BG,), float("-inf"), tl.float32)
        for g in tl.static_range(G):
            cg = tl.where(grp == g, c, float("-inf"))
            m1 = tl.max(cg, 0)
            score = m1
            if EG > 1:
                i1 = tl.min(tl.where((grp == g) & (cg == m1), e, BE), 0)
                score = m1 + tl.max(tl.where(e == i1, float("-inf"), cg), 0)
            gs = tl.where(gi == g, score, gs)
        keep = tl.zeros((BE,), dtype=tl.int1)
        gfree = gi < G
        for _ in tl.static_range(TOPG):
            m = tl.max(tl.where(gfree, gs, float("-inf")), 0)
            gbest = tl.min(tl.where(gfree & (gs == m), gi, BG), 0)
            keep = keep | (grp == gbest)
            gfree = gfree & (gi != gbest)
        c = tl.where(keep & ok, c, float("-inf"))
    j = tl.arange(0, BK)
    ids = tl.zeros((BK,), dtype=tl.int64)
    w = tl.zeros((BK,), dtype=tl.float32)
    free = ok  # experts not chosen yet: k distinct ids in [0, E) even where every choice is -inf
    for n in tl.static_range(KTOP):
        m = tl.max(tl.where(free, c, float("-inf")), 0)
        best = tl.min(tl.where(free & (c == m), e, BE), 0)
        ids = tl.where(j == n, best.to(tl.int64), ids)
        w = tl.where(j == n, tl.sum(tl.where(e == best, s, 0.0), 0), w)
        free = free & (e != best)
    if NORM:
        total = tl.zeros((), dtype=tl.float32)
        for n in tl.static_range(KTOP):  # in selection order
            total += tl.sum(tl.where(j == n, w, 0.0), 0)
        w = w / (total + 1e-20)
    tl.store(ids_ptr + t * KTOP + j, ids, mask=j < KTOP)
    tl.store(w_ptr + t * KTOP + j, w * scale, mask=j < KTOP)


def route(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1,
          norm: bool = True, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (§2.1.2: sigmoid scores, the correction bias for selection only, group-
    limited top-k, normalised and scaled weights; ``modeling.deepseek.MoE.route``) in one launch:
    logits [T, E] float32, bias [E] float32 → (ids [T, k] int64 in descending biased score — ties
    to the lower id —, weights [T, k] float32: the chosen experts' sigmoid scores, divided by their
    sum (+1e-20) when ``norm``, times ``scale``; NaN logits rank last, so the ids stay k distinct
    experts — the contract of ``specdec_kernels.moe`` — and the NaN reaches the weights). One program per row:
    a row's result is its own.
    Raises ValueError when logits is not 2-D, bias not [E], k, n_group or topk_group not ints, E not a
    multiple of n_group or k beyond the kept groups' experts."""
    if logits.dim() != 2 or bias.shape != logits.shape[1:]:
        raise ValueError(f"route: logits {tuple(logits.shape)} must be [T, E] and bias {tuple(bias.shape)} [E]")
    T, E = logits.shape
    if any(type(v) is not int for v in (k, n_group, topk_group)) or n_group < 1 or E % n_group \
            or not 1 <= topk_group <= n_group or not 1 <= k <= E // n_group * topk_group:
        raise ValueError(f"route: {E} experts in {n_group!r} groups, top-{topk_group!r} groups, top-{k!r} experts")
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T:
        _select_kernel[(T,)](logits.float().contiguous(), bias.float().contiguous(), ids, w, float(scale), E=E,
                             G=n_group, TOPG=topk_group, KTOP=k, NORM=bool(norm), BE=triton.next_power_of_2(E),
                             BG=triton.next_power_of_2(n_group), BK=triton.next_power_of_2(k), num_warps=4)
    return ids, w


def route_reference(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int = 1, topk_group: int = 1,
                    norm: bool = True, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` in float64 torch ops (the model's ``MoE.route`` after its logits)."""
    s = logits.double().sigmoid()
    c = s + bias.double()
    T, E = logits.shape
    if topk_group < n_group:
        group = c.view(T, n_group, E // n_group).topk(min(2, E // n_group), -1).values.sum(-1)
        keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(topk_group, -1).indices, True)
        c = c.masked_fill(~keep.repeat_interleave(E // n_group, 1), float("-inf"))
    ids = c.topk(k, -1).indices
    w = s.gather(1, ids)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scale
