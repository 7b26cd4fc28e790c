"""Grouped MoE experts for the row-invariant DeepSeek-V3 / Kimi-K2 forward: every routed
expert a batch touches in three launches, with no host sync, instead of a Python loop of
per-expert matmuls (plans/0007-mla-tp.md, "Session 16: grouped experts").

The routed (token, slot) pairs are sorted by expert id (stable: ascending token within an
expert) and cut into tiles of at most ``BLOCK_M`` pairs of one expert. Launch 1 gathers a
tile's token rows of x and computes gate = x·W_gateᵀ and up = x·W_upᵀ for a block of
intermediate columns, rounds both to the activation dtype and applies silu(gate)·up in fp32
(one more rounding): exactly what ``specdec_kernels.matmul.linear`` twice and ``specdec_kernels.swiglu`` give.
Launch 2 computes the tile's down projection. Launch 3 sums, per token, its k expert outputs
times their routing weights in fp32 in ascending expert id, then rounds once — the order of
``modeling.deepseek.MoE.forward``'s loop, which depends on the token alone.

Row invariance: a pair's every output element is one K loop of ``tl.dot`` over blocks of BK
(``MOE_TILES``, one tiling for every shape and row count), so it does not depend on which other
pairs share its tile, on how many there are, or on the tile's M (16 here, 64 in ``linear``)
wherever an MMA's element does not depend on the instruction's M — the tests check the outputs
equal the per-expert ``linear`` path bit for bit (same BK there; on the H200 the element does not
depend on BK either, so it holds at the Kimi shapes where ``linear`` tiles with BK 256). The weighted sum runs without FMA contraction
(``enable_fp_fusion=False``) so that it rounds as torch's separate multiply and add.
Each expert's weights are read once per (tile, column block): once per call where an expert's
pairs fit one tile (tree verify: 1–8 pairs per expert).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec_kernels.matmul import Tiles, split_k, split_sum
from specdec_kernels.swiglu import swiglu

BLOCK_M = 16  # pairs of one expert per tile (tl.dot's smallest M)
# (BN, BK, warps, stages) of the gate/up and the down projection, whatever the weight's shape: BK 128 as
# linear's default tiling (on the H200 BK 256 gives the same bits and BN, warps, stages never change one);
# bench/results/moe_kernel_h200*.md, moe_sweep_h200*.md: within 0.5 % of the best of 16 per projection at a TP8
# rank's slices, down at BN 128 2.4 % faster than BN 64 at full width (session 18, with K specialised so the loads
# pipeline: every BN within 0.6 %, moe_sweep_h200{_tp8,}_split.md)
MOE_TILES = ((64, 128, 4, 3), (128, 128, 4, 3))
# split-K counts (gate/up, down) by the experts' (intermediate I, hidden H), as specdec_kernels.matmul's TILE_TABLE keys
# split counts by weight shape (never by rows); absent: unsplit. From bench.moe_kernel --split on the H200: at
# Kimi-K2's shapes (I 256 and 2048, H 7168) no split beats the unsplit launch once its loads pipeline (session 18).
MOE_SPLIT: dict[tuple[int, int], tuple[int, int]] = {}


def moe_tiles(inter: int, hidden: int) -> tuple[Tiles, Tiles]:
    """The (gate/up, down) tilings of experts with intermediate size ``inter`` and hidden size
    ``hidden``, as ``specdec_kernels.matmul`` Tiles (BM = BLOCK_M, BN, BK, warps, stages, split-K count):
    ``MOE_TILES`` with ``MOE_SPLIT``'s counts — a function of the weight shapes only."""
    s13, s2 = MOE_SPLIT.get((inter, hidden), (1, 1))
    return (BLOCK_M, *MOE_TILES[0], s13), (BLOCK_M, *MOE_TILES[1], s2)


def loop_tiles(down: bool, inter: int, hidden: int) -> Tiles:
    """The ``specdec_kernels.matmul.linear`` tiling under which one expert's gate or up (down=False:
    weight [inter, hidden]) or down projection (down=True: [hidden, inter]) folds K exactly as
    ``moe_experts`` does — its BK and split-K count — so the per-expert loop and the grouped
    kernels give the same bits."""
    t = moe_tiles(inter, hidden)[down]
    return (64, 64, t[2], 4, 3, t[5])


@triton.jit
def _weight_tile(w_rows, s_rows, rn, nok, kk, k0, mask, ssr, FP8: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                 BK: tl.constexpr, DT: tl.constexpr):
    """A [BK, BN] tile of weight rows rn, columns kk = k0 … k0 + BK - 1 in the activations' dtype
    DT (nok: rows that exist): loaded as is, or (FP8) e4m3 bytes × the float32 scale of their (BO × BI) block, rounded to
    DT once — ``modeling.deepseek_weights.dequantize_fp8`` then ``.to(dtype)``, element for element.
    Where a K step lies in one block column (BI a multiple of BK) the scales are one per row, else
    one per element (the same values either way)."""
    if FP8:
        q = tl.load(w_rows + kk[:, None], mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        if BI % BK == 0:
            sc = tl.load(s_rows + (rn // BO) * ssr + k0 // BI, mask=nok, other=0.0)[None, :]
        else:
            sc = tl.load(s_rows + (rn[None, :] // BO) * ssr + kk[:, None] // BI, mask=mask, other=0.0)
        return (q * sc).to(DT)
    else:
        return tl.load(w_rows + kk[:, None], mask=mask, other=0.0)


@triton.jit
def _tile(tile_ptr, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's tile and column block: (expert as int64, first sorted pair, pairs, pair offsets rm [BM]
    and their mask, output columns rn [BN] and their mask (< N))."""
    t = tl.program_id(0)
    cnt = tl.load(tile_ptr + 3 * t + 2)
    rm = tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    return tl.load(tile_ptr + 3 * t).to(tl.int64), tl.load(tile_ptr + 3 * t + 1), cnt, rm, rm < cnt, rn, rn < N


@triton.jit  # (K, I, KS specialised: 16-divisible, so weight and x loads vectorise and pipeline)
def _gate_up_kernel(x_ptr, w_ptr, h_ptr, tok_ptr, tile_ptr, s_ptr, K, I, KS, SP, sx, swe, swn, sh, sse, ssr, RG,
                    IEEE: tl.constexpr, PARTIAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    FP8: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    """Program (tile, column block, split s): h[pairs, n] = silu(x[tok]·W_gate[e]ᵀ) · (x[tok]·W_up[e]ᵀ)
    over K positions [s·KS, (s+1)·KS). PARTIAL (split-K): store the two float32 folds instead, at
    h_ptr's s-th [pairs, 2I] slice (SP elements each; gate columns, then up)."""
    e, start, cnt, rm, ok, rn, nok = _tile(tile_ptr, I, BM, BN)
    if cnt > 0:
        tok = tl.load(tok_ptr + start + rm, mask=ok, other=0).to(tl.int64)
        rk = tl.arange(0, BK)
        wg = w_ptr + e * swe + rn[None, :] * swn       # W_gate rows n (of [2I, K]), as [BK, BN] tiles
        wu = wg + I * swn                              # W_up rows n
        sg = s_ptr + e * sse                           # FP8: their scale grids (the up grid after RG rows)
        su = sg + RG * ssr
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(tl.program_id(2) * KS, tl.minimum(K, (tl.program_id(2) + 1) * KS), BK):
            kk = k0 + rk
            xt = tl.load(x_ptr + tok[:, None] * sx + kk[None, :], mask=ok[:, None] & (kk[None, :] < K), other=0.0)
            wmask = nok[None, :] & (kk[:, None] < K)
            g = _weight_tile(wg, sg, rn, nok, kk, k0, wmask, ssr, FP8, BO, BI, BK, x_ptr.dtype.element_ty)
            u = _weight_tile(wu, su, rn, nok, kk, k0, wmask, ssr, FP8, BO, BI, BK, x_ptr.dtype.element_ty)
            if IEEE:
                acc_g = tl.dot(xt, g, acc_g, input_precision="ieee")
                acc_u = tl.dot(xt, u, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(xt, g, acc_g)
                acc_u = tl.dot(xt, u, acc_u)
        rows = (start + rm).to(tl.int64)[:, None]
        omask = ok[:, None] & nok[None, :]
        if PARTIAL:  # specdec_kernels.matmul.split_sum then specdec_kernels.swiglu finish them (as for two split-K linears)
            at = h_ptr + tl.program_id(2).to(tl.int64) * SP + rows * sh + rn[None, :]
            tl.store(at, acc_g, mask=omask)
            tl.store(at + I, acc_u, mask=omask)
        else:
            gate = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)   # linear's rounding, then swiglu's math
            up = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
            h = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(h_ptr + rows * sh + rn[None, :], h.to(h_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _down_kernel(h_ptr, w_ptr, y_ptr, tile_ptr, s_ptr, K, N, KS, SP, sh, swe, swn, sy, sse, ssr,
                 IEEE: tl.constexpr, PARTIAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 FP8: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr):
    """Program (tile, column block, split s): y[pairs, n] = h[pairs]·W_down[e]ᵀ over K positions
    [s·KS, (s+1)·KS), rounded to y's dtype — or (PARTIAL) stored in float32 at y's s-th slice."""
    e, start, cnt, rm, ok, rn, nok = _tile(tile_ptr, N, BM, BN)
    if cnt > 0:
        rows = (start + rm).to(tl.int64)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(tl.program_id(2) * KS, tl.minimum(K, (tl.program_id(2) + 1) * KS), BK):
            kk = k0 + rk
            ht = tl.load(h_ptr + rows[:, None] * sh + kk[None, :], mask=ok[:, None] & (kk[None, :] < K), other=0.0)
            w = _weight_tile(w_ptr + e * swe + rn[None, :] * swn, s_ptr + e * sse, rn, nok, kk, k0,
                             nok[None, :] & (kk[:, None] < K), ssr, FP8, BO, BI, BK, h_ptr.dtype.element_ty)
            if IEEE:
                acc = tl.dot(ht, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(ht, w, acc)
        at = y_ptr + rows[:, None] * sy + rn[None, :]
        if PARTIAL:
            tl.store(at + tl.program_id(2).to(tl.int64) * SP, acc, mask=ok[:, None] & nok[None, :])
        else:
            tl.store(at, acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & nok[None, :])


@triton.jit
def _weighted_sum_kernel(y_ptr, pos_ptr, wt_ptr, o_ptr, N, sy, so, KTOP: tl.constexpr, BN: tl.constexpr):
    """Program (token, column block): o = Σ_j y[pos_j]·w_j in fp32, j in ascending expert id."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = cols < N
    acc = tl.zeros((BN,), dtype=tl.float32)
    for j in tl.static_range(KTOP):
        p = tl.load(pos_ptr + t * KTOP + j).to(tl.int64)
        w = tl.load(wt_ptr + t * KTOP + j)
        acc = acc + tl.load(y_ptr + p * sy + cols, mask=ok, other=0.0).to(tl.float32) * w
    tl.store(o_ptr + t * so + cols, acc.to(o_ptr.dtype.element_ty), mask=ok)


# up to this many (token, slot) pairs the sort and tile table are one launch (_expert_tiles_kernel: one program
# sorts the pairs' keys in registers); beyond, the torch ops (~25 launches). H200, CUDA graph
# (bench/results/moe_sort_h200_s19.md): 5.0 / 7.5 / 10.8 / 20.4 / 57 µs at 64 / 512 / 1024 / 2048 / 4096 pairs
# (4, 4, 8, 16, 16 warps) against the torch ops' 76–119 µs.
SMALL_PAIRS = 4096


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _expert_tiles_kernel(ids_ptr, w_ptr, tok_ptr, tile_ptr, pos_ptr, slot_ptr, wt_ptr, scratch_ptr, P, NMAX, E,
                         KTOP: tl.constexpr, BP: tl.constexpr, BM: tl.constexpr):
    """One program: ``expert_tiles`` for P ≤ BP pairs. Pair i's key expert·BP + i (distinct) sorted
    in registers puts the r-th pair of the stable expert order in lane r; a lane opens a tile when
    its place in its expert's run (r − the run's first lane, a max-scan) is a multiple of BM, the
    tile's index is the count of opening lanes before it (a cumsum) and its size min(run end − r,
    BM) (the run's end: a reverse min-scan). Its place in its token's ascending expert ids is the
    count of its token's pairs of a smaller expert. scratch_ptr: int32 [2·BP]."""
    i = tl.arange(0, BP)
    ok = i < P
    e_i = tl.load(ids_ptr + i, mask=ok, other=E).to(tl.int32)
    valid = (e_i >= 0) & (e_i < E)  # (an id outside [0, E) sorts last, with the padding, and opens no tile)
    key = tl.sort(tl.where(valid, e_i, E) * BP + i)
    src = key % BP                        # lane r: the r-th pair in expert order
    es = key // BP                        # and its expert
    tl.store(tok_ptr + i, src // KTOP, mask=ok)
    tl.store(scratch_ptr + src, i, mask=ok)           # the sorted position of pair src
    tl.store(scratch_ptr + BP + i, es, mask=ok)
    tl.debug_barrier()  # the stores above, visible to every thread of the program
    rank = tl.load(scratch_ptr + i, mask=ok, other=0)
    prev = tl.load(scratch_ptr + BP + i - 1, mask=ok & (i > 0), other=-1)
    nxt = tl.load(scratch_ptr + BP + i + 1, mask=i + 1 < P, other=-1)
    first = tl.associative_scan(tl.where(es != prev, i, 0), 0, _max_combine)
    end = tl.associative_scan(tl.where(es != nxt, i + 1, BP + 1), 0, _min_combine, reverse=True)
    opens = ok & (es < E) & ((i - first) % BM == 0)  # (tiles only of experts in range)
    tile = tl.cumsum(opens.to(tl.int32), 0) - 1
    n_tiles = tl.sum(opens.to(tl.int32), 0)
    opens = opens & (tile < NMAX)  # (never past the table, whatever the ids)
    tl.store(tile_ptr + 3 * tile, es, mask=opens)
    tl.store(tile_ptr + 3 * tile + 1, i, mask=opens)
    tl.store(tile_ptr + 3 * tile + 2, tl.minimum(end - i, BM), mask=opens)
    for t0 in range(0, NMAX, BP):  # unused tiles: 0 pairs
        t = t0 + i
        tl.store(tile_ptr + 3 * t + 2, tl.zeros((BP,), dtype=tl.int32), mask=(t >= n_tiles) & (t < NMAX))
    t_i = i // KTOP
    in_tok = tl.zeros((BP,), dtype=tl.int32)  # the token's pairs of a smaller expert (or of its own, earlier:
    for j in tl.static_range(KTOP):             # only a repeated id, outside the contract — every place written)
        e_j = tl.load(ids_ptr + t_i * KTOP + j, mask=ok, other=0).to(tl.int32)
        in_tok += ((e_j < e_i) | ((e_j == e_i) & (j < i % KTOP))).to(tl.int32)
    at = t_i * KTOP + in_tok
    tl.store(pos_ptr + at, rank.to(tl.int64), mask=ok)
    tl.store(slot_ptr + at, (i % KTOP).to(tl.int64), mask=ok)
    tl.store(wt_ptr + at, tl.load(w_ptr + i, mask=ok, other=0.0).to(tl.float32), mask=ok)


def expert_tiles(ids: torch.Tensor, n_experts: int, block_m: int = BLOCK_M, weights: torch.Tensor | None = None):
    """Sort the (token, slot) pairs of ``ids`` [T, k] (int64 or int32 expert ids, distinct per
    token) by expert, stably, and cut them into tiles of ≤ block_m pairs of one expert, on the
    device (no host sync). Returns (tok [P] int32: the token of each sorted pair, tiles [n_max, 3]
    int32: (expert, first sorted pair, pairs) — tiles in ascending expert id, then pair; a tile of
    0 pairs is unused (its other fields unspecified), n_max = ⌈P/block_m⌉ + min(E, P) bounds the
    tiles —, pos [T, k] int64: the sorted position of each token's pairs in ascending expert id,
    slot [T, k] int64: their slots, wt [T, k] float32: ``weights`` [T, k] in that order, or None),
    P = T·k. Up to ``SMALL_PAIRS`` pairs one launch (``_expert_tiles_kernel``), else
    ``expert_tiles_reference``'s torch ops; the same outputs either way (test). Ids outside the
    contract (repeated in a token, ≥ E: not checked, that would sync) give wrong tiles but no write
    outside the outputs. Raises ValueError on a non-2-D or non-integer ids, n_experts or block_m
    below 1, or weights not of ids' shape."""
    check_tiles_args(ids, n_experts, block_m, weights)
    T, k = ids.shape
    P = T * k
    if P > SMALL_PAIRS or P == 0 or not keys_fit(n_experts, P):
        tok, tiles, pos, slot = expert_tiles_reference(ids, n_experts, block_m)
        return tok, tiles, pos, slot, None if weights is None else weights.float().gather(1, slot).contiguous()
    return expert_tiles_one_launch(ids, n_experts, block_m, weights, num_warps=4 if P <= 512 else 8 if P <= 1024 else 16)


def keys_fit(n_experts: int, pairs: int) -> bool:
    """Whether ``_expert_tiles_kernel``'s int32 sort keys (expert · BP + pair) hold E experts × P pairs."""
    return n_experts * max(16, triton.next_power_of_2(pairs)) < 2**31


def check_tiles_args(ids, n_experts, block_m, weights) -> None:
    """``expert_tiles``' host-side argument checks (ValueError naming the argument)."""
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"expert_tiles: ids must be an integer [T, k] tensor, got {ids.dtype} {tuple(ids.shape)}")
    for name, v in (("n_experts", n_experts), ("block_m", block_m)):
        if type(v) is not int or v < 1:
            raise ValueError(f"expert_tiles: {name} must be an int >= 1, got {v!r}")
    if weights is not None and weights.shape != ids.shape:
        raise ValueError(f"expert_tiles: weights {tuple(weights.shape)} must have ids' shape {tuple(ids.shape)}")


def expert_tiles_one_launch(ids: torch.Tensor, n_experts: int, block_m: int = BLOCK_M,
                            weights: torch.Tensor | None = None, num_warps: int = 4):
    """``expert_tiles`` by ``_expert_tiles_kernel`` whatever P (one program holds all P pairs in
    registers: for tree-verify sizes; the bench times it beyond ``SMALL_PAIRS``). Raises ValueError
    as ``expert_tiles`` and where n_experts · P's power of two reaches 2³¹ (int32 sort keys)."""
    check_tiles_args(ids, n_experts, block_m, weights)
    if not keys_fit(n_experts, ids.numel()):
        raise ValueError(f"expert_tiles_one_launch: {n_experts} experts × {ids.numel()} pairs overflow its int32 keys")
    T, k = ids.shape
    P = T * k
    dev = ids.device
    n_max = -(-P // block_m) + min(n_experts, P)
    tok = torch.empty(P, dtype=torch.int32, device=dev)
    tiles = torch.empty(n_max, 3, dtype=torch.int32, device=dev)
    pos, slot = (torch.empty(T, k, dtype=torch.int64, device=dev) for _ in range(2))
    wt = torch.empty(T, k, dtype=torch.float32, device=dev)
    BP = max(16, triton.next_power_of_2(P))
    scratch = torch.empty(2 * BP, dtype=torch.int32, device=dev)
    w = weights.contiguous() if weights is not None else wt
    _expert_tiles_kernel[(1,)](ids.contiguous(), w, tok, tiles, pos, slot, wt, scratch, P, n_max, n_experts,
                               KTOP=k, BP=BP, BM=block_m, num_warps=num_warps)
    return tok, tiles, pos, slot, None if weights is None else wt


def expert_tiles_reference(ids: torch.Tensor, n_experts: int, block_m: int = BLOCK_M):
    """``expert_tiles`` in torch ops (any P; ~25 launches): (tok, tiles, pos, slot)."""
    T, k = ids.shape
    flat = ids.flatten().long()
    P = flat.numel()
    order = flat.argsort(stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(P, device=ids.device)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).index_add_(  # (bincount syncs)
        0, flat, torch.ones_like(flat))
    ntile = (counts + block_m - 1) // block_m
    cum = ntile.cumsum(0)
    n_max = -(-P // block_m) + min(n_experts, P)
    t = torch.arange(n_max, device=ids.device)
    e = torch.searchsorted(cum, t, right=True).clamp_(max=n_experts - 1)
    j = t - (cum - ntile)[e]
    start = (counts.cumsum(0) - counts)[e] + j * block_m
    cnt = torch.where(t < cum[-1], (counts[e] - j * block_m).clamp(0, block_m), 0)
    tiles = torch.stack([e, start, cnt], 1).to(torch.int32).contiguous()
    _, slot = ids.sort(dim=1)                         # (distinct ids) a token's slots in ascending expert id
    pos = inv.view(T, k).gather(1, slot)
    return (order // k).to(torch.int32), tiles, pos.contiguous(), slot


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, block_m: int = BLOCK_M, tiles: tuple | None = None,
                scales: tuple[torch.Tensor, torch.Tensor] | None = None, block: tuple[int, int] = (128, 128)
                ) -> torch.Tensor:
    """Routed experts of one MoE layer: Σ_j weights[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t))
    over e = ids[t, j], summed in ascending expert id in fp32, rounded once.

    x [T, H] (bf16, fp16 or fp32; fp32 uses IEEE products), w13 [E, 2I, H] (each expert's
    gate rows then up rows, as ``nn.Linear`` weights), w2 [E, H, I] (both with unit stride along
    the last dimension), ids [T, k] int64 or int32 (distinct per token, in [0, E): not checked,
    which would cost a host sync — the router's top-k gives such ids), weights [T, k] float32. Returns [T, H] in x.dtype. block_m: pairs per tile (a
    power of two ≥ 16; it does not change the result). tiles: (gate/up, down) ``specdec_kernels.matmul``
    tilings (BM ignored) instead of ``MOE_TILES`` (sweeps). scales: weights kept in FP8 —
    w13, w2 float8_e4m3fn (or their uint8 bytes) with float32 block scales (s13 [E, 2·⌈I/bo⌉, ⌈H/bi⌉]:
    the gate grid then the up grid; s2 [E, ⌈H/bo⌉, ⌈I/bi⌉]) for blocks ``block`` = (bo, bi): each
    weight tile is dequantised as it is loaded, exactly as ``dequantize_fp8`` then ``.to(x.dtype)``.
    Raises ValueError on mismatched shapes or dtypes."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or ids.dim() != 2:
        raise ValueError(f"moe_experts: need x [T, H], w13 [E, 2I, H], w2 [E, H, I], ids [T, k]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}, {tuple(ids.shape)}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"moe_experts: block_m {block_m} must be a power of two >= 16")
    T, H = x.shape
    E, two_i, H2 = w13.shape
    inter = two_i // 2
    fp8 = scales is not None
    wdt = (torch.float8_e4m3fn, torch.uint8) if fp8 else (x.dtype,)
    bo, bi = block
    grids = ((E, 2 * -(-inter // bo), -(-H // bi)), (E, -(-H // bo), -(-inter // bi)))
    if H2 != H or two_i % 2 or w2.shape != (E, H, inter) or ids.shape != weights.shape or ids.shape[0] != T \
            or w13.stride(-1) != 1 or w2.stride(-1) != 1 or ids.dtype not in (torch.int64, torch.int32) \
            or w13.dtype not in wdt or w2.dtype not in wdt \
            or (fp8 and (tuple(scales[0].shape), tuple(scales[1].shape)) != grids):
        raise ValueError(f"moe_experts: x {tuple(x.shape)} {x.dtype}, w13 {tuple(w13.shape)} {w13.dtype} "
                         f"(last-dim stride {w13.stride(-1)}), w2 {tuple(w2.shape)} {w2.dtype} (last-dim stride "
                         f"{w2.stride(-1)}), ids {tuple(ids.shape)} {ids.dtype}, weights {tuple(weights.shape)}; "
                         "need w13 [E, 2I, H] and w2 [E, H, I] in x's dtype with unit last-dim stride, int ids"
                         + (f", scales {[tuple(v.shape) for v in scales]} (expected {list(grids)} for {bo}x{bi} "
                            "blocks)" if fp8 else ""))
    if fp8:
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
        s13, s2 = (v.float().contiguous() for v in scales)
    else:
        s13 = s2 = x  # (unused)
    k = ids.shape[1]
    x = x.contiguous()
    t13, t2 = tiles or moe_tiles(inter, H)
    tok, table, pos, slot, wt = expert_tiles(ids, E, block_m, weights)
    P = T * k
    ieee = x.dtype == torch.float32
    meta = dict(IEEE=ieee, BM=block_m, FP8=fp8, BO=bo, BI=bi)

    def run(kernel, t, n, K, args, width, strides):
        """Launch ``kernel`` (args: its pointers before and after the output's) over the tiles ×
        column blocks of n × the split-K runs of K in tiling t; returns [P, n] in x's dtype, or
        with split-K the float32 partials [S, P, width] (gate/up: width 2I, gate then up)."""
        _, bn, bk, warps, stages, split = (*t, 1)[:6]
        if type(split) is not int or split < 1:
            raise ValueError(f"moe_experts: the split-K count (tiles[5]) must be an int >= 1, got {split!r}")
        ks, split = split_k(K, bk, split)
        out = (torch.empty(split, P, width, device=x.device, dtype=torch.float32) if split > 1
               else torch.empty(P, n, device=x.device, dtype=x.dtype))
        kernel[(table.shape[0], triton.cdiv(n, bn), split)](
            *args[:2], out, *args[2:], K, n, ks, P * width, args[0].stride(0), args[1].stride(0), args[1].stride(1),
            out.stride(-2), *strides, PARTIAL=split > 1, BN=bn, BK=bk, num_warps=warps, num_stages=stages, **meta)
        return out

    def scale_strides(sc):
        return (sc.stride(0), sc.stride(1)) if fp8 else (0, 0)

    h = run(_gate_up_kernel, t13, inter, H, (x, w13, tok, table, s13), 2 * inter, (*scale_strides(s13), -(-inter // bo)))
    if h.dim() == 3:  # split-K: gate ‖ up summed and rounded as split linears are, then specdec_kernels.swiglu's activation
        h = swiglu(split_sum(h, torch.empty(P, 2 * inter, device=x.device, dtype=x.dtype)))
    y = run(_down_kernel, t2, H, inter, (h, w2, table, s2), H, scale_strides(s2))
    if y.dim() == 3:
        y = split_sum(y, torch.empty(P, H, device=x.device, dtype=x.dtype))
    out = torch.empty(T, H, device=x.device, dtype=x.dtype)
    _weighted_sum_kernel[(T, triton.cdiv(H, 1024))](y, pos, wt, out, H, y.stride(0), out.stride(0), KTOP=k, BN=1024,
                                                    num_warps=4, enable_fp_fusion=False)
    return out


def moe_experts_reference(x, w13, w2, ids, weights, scales=None, block=(128, 128)) -> torch.Tensor:
    """float64 reference of ``moe_experts`` (no intermediate rounding; FP8 weights dequantised
    by ``modeling.deepseek_weights.dequantize_fp8``)."""
    xd, inter = x.double(), w13.shape[1] // 2
    if scales is not None:
        from modeling.deepseek_weights import dequantize_fp8

        rg = -(-inter // block[0])
        f8 = torch.float8_e4m3fn
        w13 = torch.stack([torch.cat([dequantize_fp8(w[:inter].view(f8), s[:rg], block),
                                      dequantize_fp8(w[inter:].view(f8), s[rg:], block)]) for w, s in zip(w13, scales[0])])
        w2 = torch.stack([dequantize_fp8(w.view(f8), s, block) for w, s in zip(w2, scales[1])])
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].double().tolist()):
            g, u = (xd[t] @ w13[e].double().T).split(inter)
            out[t] += w * ((torch.nn.functional.silu(g) * u) @ w2[e].double().T)
    return out
