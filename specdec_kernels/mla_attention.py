"""Absorbed MLA attention for tree verify over the MLA latent cache (DeepSeek-V2/V3 MLA with W_UK
folded into the query; plans/0007-mla-tp.md), row-invariant as ``specdec_kernels/tree_attention.py``.

Per query row i (tree node at depth δ_i of a request with L committed rows, absolute position
P_i = L + δ_i) and head: scores against the latent rows c ‖ k_pe (C + R values, one "KV head"
shared by all heads) at positions 0…P_i, softmax with an explicit scale, output the
probability-weighted latent (V = the first C values of each row). Position p < L reads pool
row ``base + p``; position L + j reads i's ancestor at depth j (``base + L + anc[i, j]``) — or,
over a paged pool, the rows the request's page table maps those logical rows to (``pages``).

Work split (flash-decoding): a program owns one tile of up to BLOCK_R consecutive query rows
of one request × all h heads (M = BLOCK_R·h rows of every dot, 64 by default, so one 576-wide
latent block feeds 64 query rows) and one chunk of CHUNK absolute positions; it writes per
(row, head) fp32 partials (max, sum, acc), and a second kernel folds a row's chunks
0…⌊P_i/CHUNK⌋ in chunk order. Chunks give parallelism over the KV length at small batch.

Order of the reduction (what makes it row-invariant): chunks and blocks of BN positions are
aligned to absolute position 0, and every block, whoever loads it, goes through the same
``_step`` (same dot shapes, same masking by ``position <= P_row``, same update), so a row's
arithmetic depends only on its own position and keys. Blocks wholly below ⌊L/BN⌋·BN are
loaded once for the tile. A block holding tree positions is loaded per *leader*: rows are
visited deepest-first (reverse order); a row not yet served gathers its own root path for
the block's positions, and serves with that one load every unserved tile row whose path
agrees with it up to the block's end (its ancestors in the tile, typically) — the others wait
for their own turn. Each row is served exactly once per block, by a load holding exactly its
keys, so a node at depth δ gives bit for bit what a one-row decode at L + δ gives after its
path is committed. Masked keys contribute exact zeros (p = 2^-inf = 0, α = 2^0 = 1).
A tree block is folded in two passes: the first finds the leaders and the rows each serves
(bit masks, no key loads), the second gathers one block per leader in a loop without branches,
so the gathers can be pipelined (``tail_stages``).

V split (``vsplit`` 2, session 7): two programs per (tile, chunk), each owning half of the 512
V columns. Triton puts a chained dot's warps all along M, so with 8 warps and M = 64 both
warpgroups computed the whole score tile, in 64×32 MMAs (bound by shared-memory reads: 3 KB
per 32 K MACs). With the accumulator halved, 4 warps hold it; both programs still compute the
whole score tile (the same total score work) but in 64×64 MMAs, and a program's chain of
blocks carries half the MMA work (twice the programs, shorter chains at small batch). Each
program sums its own columns' scores first (own half, other half, rope), so the halves carry
their own (m, l), combined per half: the split is part of the arithmetic. Measured on the H200
(session 7, bench/results/mla_kernel_h200.md): exact and row-invariant, 12 % faster at
L 32k / tree 8 / batch 1 but 14 % slower at 16k/256/32 and 39 % at 1k/64/32 (one 4-warp program
per SM: nothing overlaps its softmax with its MMAs), so the default stays vsplit 1.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

BLOCK_N = 64      # key positions per block
CHUNK = 2048      # key positions per split (partials are combined in chunk order; 1024 before session 13)
TAIL_STAGES = 2   # pipelined tree-block gathers (H200 session 8: 1024/64/32 0.351 vs 0.384 ms, same bits as 1)
VSPLIT = 1        # programs per (tile, chunk), each owning C / VSPLIT of the V columns (2 lost on the H200)
COMBINE_WARPS = 4  # the combine launch: one program per row (all heads, a V split's columns) …
COMBINE_ROWS_PER_SM = 1  # … from this many rows per SM (fewer: a 1-warp program per row, head and 128 columns;
                         # H200 session 15: per head faster at 64 rows, per row at 256)
TAIL_ROWS_PER_SM = 2  # tail_rows=None: one tree-launch program per row up to this many per SM (H200 session 13)
TAIL_M = 16       # tail_m=None: rows of the tree-launch dots, at least one row's h (64 before session 15; H200,
TAIL_WARPS = 4    # mla_kernel_h200_tail_m_s15.md: 16 rows in 4 warps took 0.70-1.02 of the 64-row launch's call time,
                  # median 0.94, within 3 % of the fastest variant at every cell)
PREFIX = "auto"  # the committed-prefix launch (mla_attention's `prefix`): Gluon on Hopper, same bits as Triton
_FITS: dict = {}  # (dtype, shape, knobs) -> pipeline stages that fit in shared memory


@triton.jit
def _step(q_a, q_b, q_r, ka, kb, kr, valid, m, l, acc, qk_scale, IEEE: tl.constexpr, VSPLIT: tl.constexpr):
    """One block of BN keys for BM query rows: scores (log2 units), online-softmax update.
    Every block of every path goes through here: the same arithmetic for shared and gathered
    keys (and specdec_kernels/mla_prefix.py's Gluon launch repeats it operation for operation). Scores sum
    the program's own latent columns first (q_a·kaᵀ), then the other half (q_b·kbᵀ, VSPLIT = 2
    only), then rope; V = ka (the program's CV = C / VSPLIT columns).
    valid [BM, BN]: key visible to the row (invisible → exactly no change to the row)."""
    if IEEE:
        s = tl.dot(q_a, tl.trans(ka), input_precision="ieee")
        if VSPLIT == 2:
            s = tl.dot(q_b, tl.trans(kb), s, input_precision="ieee")
        s = tl.dot(q_r, tl.trans(kr), s, input_precision="ieee")
    else:
        s = tl.dot(q_a, tl.trans(ka))
        if VSPLIT == 2:
            s = tl.dot(q_b, tl.trans(kb), s)
        s = tl.dot(q_r, tl.trans(kr), s)
    s = tl.where(valid, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None]).to(ka.dtype)
    # the row sum as an MMA, P·1 (the P the numerator uses): an MMA element does not depend on the
    # layout, a tl.sum's order does — so the Gluon prefix launch (specdec_kernels/mla_prefix.py) matches
    ones = tl.full((p.shape[1], 16), 1.0, ka.dtype)
    if IEEE:
        l = l * alpha + tl.max(tl.dot(p, ones, input_precision="ieee"), axis=1)
        acc = tl.dot(p, ka, acc * alpha[:, None], input_precision="ieee")
    else:
        l = l * alpha + tl.max(tl.dot(p, ones), axis=1)
        acc = tl.dot(p, ka, acc * alpha[:, None])
    return m_new, l, acc


@triton.jit
def _pool_row(pg_ptr, base, q, PAGED: tl.constexpr, PR: tl.constexpr):
    """Pool row of a request's logical row q (position p < L, or L + tree node): ``base + q``, or with
    page tables (PAGED) row q % PR of page ``pg[base + q // PR]`` (base: the request's table offset)."""
    if PAGED:
        return tl.load(pg_ptr + base + q // PR).to(tl.int64) * PR + q % PR
    else:
        return base + q


@triton.jit
def _tree_blocks(q_a, q_b, q_r, m, l, acc, kv_ptr, pos_ptr, anc_ptr, pg_ptr, pos_m, row, rr, hh, r0, nr, base, L,
                 L0, cs, p_max, s_anc, skv_row, cola, colb, dr, nb, qk_scale, SUB: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, CHUNK: tl.constexpr, C: tl.constexpr, IEEE: tl.constexpr, VSPLIT: tl.constexpr,
                 TSTAGES: tl.constexpr, PAGED: tl.constexpr, PR: tl.constexpr):
    """The blocks of chunk ``cs`` holding tree keys (from ⌊L/BN⌋·BN), folded per leader into the
    state (m, l, acc) of the program's rows r0 … r0 + nr - 1 (at most SUB): see ``_mla_chunk_kernel`` (TAIL)."""
    for start in range(tl.maximum(cs, L0), tl.minimum(cs + CHUNK, p_max + 1), BN):  # blocks with tree keys
        p_abs = start + nb
        in_tree = p_abs >= L
        # ancestors read in bounds: every tile row's depth is < the width of anc
        aidx = tl.where(in_tree, p_abs - L, 0)
        amask = in_tree & (p_abs <= p_max)
        done = pos_m < start                                           # row not in this block
        e = tl.minimum(pos_m, start + BN - 1)                          # row's last position here
        e_node = tl.load(anc_ptr + row * s_anc + (e - L), mask=~done, other=-1)
        # pass 1, no key loads: the leaders in turn (deepest rows first) and, as a bit mask
        # over the program's rows, the rows each serves (SUB = 1: the one row, itself)
        kk = tl.arange(0, 2 * SUB)
        lead = tl.zeros((2 * SUB,), tl.int32)                          # k-th leader's row
        bits = tl.zeros((2 * SUB,), tl.int32)                          # rows it serves
        one = tl.full((BM,), 1, tl.int32)
        nl = 0
        if SUB == 1:
            bits = tl.where(kk == 0, 1, bits)
            nl = 1
        if SUB > 1:
            for jj in range(0, nr):
                j = nr - 1 - jj
                if tl.max(tl.where(rr == j, done.to(tl.int32), 0), axis=0) == 0:
                    pos_j = tl.load(pos_ptr + r0 + j)
                    j_node = tl.load(anc_ptr + (r0 + j) * s_anc + (e - L), mask=~done, other=-2)
                    serve = (~done) & (e <= pos_j) & (j_node == e_node)   # same keys here as row j
                    sb = tl.sum(tl.where(serve & (hh == 0), one << rr, 0), axis=0)
                    lead = tl.where(kk == nl, j.to(tl.int32), lead)
                    bits = tl.where(kk == nl, sb, bits)
                    nl += 1
                    done = done | serve
        # pass 2: one gathered block per leader, serving its rows (a loop without branches:
        # its gathers may be pipelined straight into shared memory)
        for k in tl.range(0, nl, num_stages=TSTAGES):
            j = tl.sum(tl.where(kk == k, lead, 0), axis=0)
            sb = tl.sum(tl.where(kk == k, bits, 0), axis=0)
            pos_j = tl.load(pos_ptr + r0 + j)
            node = tl.load(anc_ptr + (r0 + j) * s_anc + aidx, mask=amask, other=0)
            kval = p_abs <= pos_j
            gslot = _pool_row(pg_ptr, base, tl.where(in_tree, L + node, p_abs), PAGED, PR)
            gp = kv_ptr + gslot[:, None] * skv_row
            gka = tl.load(gp + cola[None, :], mask=kval[:, None], other=0.0)
            if VSPLIT == 2:
                gkb = tl.load(gp + colb[None, :], mask=kval[:, None], other=0.0)
            else:
                gkb = gka
            gkr = tl.load(gp + C + dr[None, :], mask=kval[:, None], other=0.0)
            serve = ((sb >> rr) & 1) != 0
            gvalid = (p_abs[None, :] <= pos_m[:, None]) & serve[:, None]
            m, l, acc = _step(q_a, q_b, q_r, gka, gkb, gkr, gvalid, m, l, acc, qk_scale, IEEE, VSPLIT)
    return m, l, acc


@triton.jit(do_not_specialize=["s_anc", "NCH", "NKV"])  # one compile per tiling, whatever the tree width / grid
def _mla_chunk_kernel(q_ptr, kv_ptr, pm_ptr, pl_ptr, pacc_ptr, pos_ptr, anc_ptr, tile_ptr, pg_ptr,
                      sq_row, sq_head, skv_row, s_anc, qk_scale, NCH, NKV,
                      H: tl.constexpr, BLOCK_R: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                      BN: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr, STAGES: tl.constexpr,
                      TAIL: tl.constexpr, TMA: tl.constexpr, VSPLIT: tl.constexpr, TSTAGES: tl.constexpr = 1,
                      SUB: tl.constexpr = 0, TM: tl.constexpr = 0, PAGED: tl.constexpr = False,
                      PR: tl.constexpr = 128):
    """Program (tile · VSPLIT + vh, chunk). TAIL=False: folds the chunk's prefix blocks (below
    ⌊L/BN⌋·BN, one load for the tile) and stores the state (m, l, acc of V columns
    vh·CV … vh·CV + CV) as the chunk's partial; a chunk with no prefix block is not written.
    TAIL=True (run after): the k-th chunk from the tile's first tree block: reloads that state
    (or starts from the empty one where the chunk has no prefix block) and continues the same fold over the blocks
    holding tree keys, per leader. Two launches so that the pipelined prefix loop keeps its
    registers (the fold is unchanged). TMA: prefix blocks by Hopper tensor-memory-access loads
    (no per-thread addresses); the same bytes, so the same results. VSPLIT = 2: each program
    owns half of the V columns (CV = C/2, accumulator [BM, CV]: 4 warps suffice, and the score
    dot is no longer duplicated on two warpgroups); it computes the full scores itself.
    SUB, TM (TAIL only): program ((tile · BLOCK_R / SUB + s) · VSPLIT + vh, chunk) folds the tree blocks
    of the tile's rows s·SUB … s·SUB + SUB - 1 (leaders among them; SUB = 1: the row alone, its own
    leader, no search) in dots of TM ≥ SUB·H rows (the rest masked): a small tile's rows run in
    parallel, and TM < BLOCK_R·H wastes fewer MMA rows on a leader serving few rows. Each row still
    folds exactly its own keys through the same ``_step``, so the bits are the per-tile fold's
    wherever an MMA's element does not depend on the instruction's M (the GPU tests and the
    bench's per-column bit check say whether it does on the device)."""
    if TAIL:
        t = tl.program_id(0) // (VSPLIT * (BLOCK_R // SUB))
        s = tl.program_id(0) // VSPLIT % (BLOCK_R // SUB)
        BM: tl.constexpr = TM
    else:
        t = tl.program_id(0) // VSPLIT
        s = 0
        BM: tl.constexpr = BLOCK_R * H
    vh = tl.program_id(0) % VSPLIT
    CV: tl.constexpr = C // VSPLIT
    r0 = tl.load(tile_ptr + t * 4) + s * SUB
    nr = tl.load(tile_ptr + t * 4 + 1) - s * SUB
    base = tl.load(tile_ptr + t * 4 + 2)
    L = tl.load(tile_ptr + t * 4 + 3)
    L0 = (L // BN) * BN                # first block holding a tree position
    if TAIL:
        ch = L0 // CHUNK + tl.program_id(1)
    else:
        ch = tl.program_id(1)
    mm = tl.arange(0, BM)
    rr = mm // H                       # row of the tile
    hh = mm % H                        # head
    if TAIL:
        ok = (rr < nr) & (rr < SUB)    # rows past the program's own: not loaded, not folded, not stored
    else:
        ok = rr < nr
    row = r0 + rr
    pos_m = tl.load(pos_ptr + row, mask=ok, other=-1)                         # [BM] P of the row
    p_max = tl.max(pos_m, axis=0)
    cs = ch * CHUNK
    ca = vh * CV                       # this program's V columns
    cb = (ca + CV) % C                 # the other half (VSPLIT = 2)
    cola = ca + tl.arange(0, CV)
    colb = cb + tl.arange(0, CV)
    dr = tl.arange(0, R)
    nb = tl.arange(0, BN)
    part = row * NCH + ch                                                       # [BM]
    pml = (part * VSPLIT + vh) * H + hh                                         # [BM] m, l slot
    # the prefix launch writes only chunks holding prefix blocks (below L0); the tree launch starts
    # any later chunk from the empty state instead of a stored one (the same values, no round trip)
    if TAIL:
        live = cs <= p_max
    else:
        live = cs < L0
    if live:
        qa = q_ptr + row[:, None] * sq_row + hh[:, None] * sq_head
        q_a = tl.load(qa + cola[None, :], mask=ok[:, None], other=0.0)         # [BM, CV]
        if VSPLIT == 2:
            q_b = tl.load(qa + colb[None, :], mask=ok[:, None], other=0.0)     # [BM, CV]
        else:
            q_b = q_a
        q_r = tl.load(qa + C + dr[None, :], mask=ok[:, None], other=0.0)       # [BM, R]
        if TAIL:
            if cs < L0:
                m = tl.load(pm_ptr + pml, mask=ok, other=-1.0e30)
                l = tl.load(pl_ptr + pml, mask=ok, other=0.0)
                acc = tl.load(pacc_ptr + (part * H + hh)[:, None] * C + cola[None, :], mask=ok[:, None], other=0.0)
            else:
                m = tl.full((BM,), -1.0e30, tl.float32)
                l = tl.zeros((BM,), tl.float32)
                acc = tl.zeros((BM, CV), tl.float32)
            m, l, acc = _tree_blocks(q_a, q_b, q_r, m, l, acc, kv_ptr, pos_ptr, anc_ptr, pg_ptr, pos_m, row, rr,
                                     hh, r0, tl.minimum(nr, SUB), base, L, L0, cs, p_max, s_anc, skv_row, cola, colb,
                                     dr, nb, qk_scale, SUB, BM, BN, CHUNK, C, IEEE, VSPLIT, TSTAGES, PAGED, PR)
        else:
            m = tl.full((BM,), -1.0e30, tl.float32)  # finite: 2^(m - m) = 1, never NaN
            l = tl.zeros((BM,), tl.float32)
            acc = tl.zeros((BM, CV), tl.float32)
            if TMA:
                dkc = tl.make_tensor_descriptor(kv_ptr, shape=[NKV, C], strides=[skv_row, 1], block_shape=[BN, CV])
                dkr = tl.make_tensor_descriptor(kv_ptr + C, shape=[NKV, R], strides=[skv_row, 1], block_shape=[BN, R])
            for start in tl.range(cs, tl.minimum(cs + CHUNK, L0), BN, num_stages=STAGES):  # one load per tile
                if TMA:  # (a block never straddles a page: PR is a multiple of BN)
                    r0k = _pool_row(pg_ptr, base, start, PAGED, PR).to(tl.int32)
                    ka = dkc.load([r0k, ca])                                          # [BN, CV]
                    if VSPLIT == 2:
                        kb = dkc.load([r0k, cb])                                      # [BN, CV]
                    else:
                        kb = ka
                    kr = dkr.load([r0k, 0])                                           # [BN, R]
                else:
                    slot = _pool_row(pg_ptr, base, start + nb, PAGED, PR)
                    kp = kv_ptr + slot[:, None] * skv_row
                    ka = tl.load(kp + cola[None, :])                              # [BN, CV]
                    if VSPLIT == 2:
                        kb = tl.load(kp + colb[None, :])                          # [BN, CV]
                    else:
                        kb = ka
                    kr = tl.load(kp + C + dr[None, :])                            # [BN, R]
                valid = (start + nb)[None, :] <= pos_m[:, None]
                m, l, acc = _step(q_a, q_b, q_r, ka, kb, kr, valid, m, l, acc, qk_scale, IEEE, VSPLIT)
        tl.store(pm_ptr + pml, m, mask=ok)
        tl.store(pl_ptr + pml, l, mask=ok)
        tl.store(pacc_ptr + (part * H + hh)[:, None] * C + cola[None, :], acc, mask=ok[:, None])


@triton.jit(do_not_specialize=["NCH"])
def _mla_combine_kernel(pm_ptr, pl_ptr, pacc_ptr, pos_ptr, o_ptr, so_row, NCH,
                        H: tl.constexpr, C: tl.constexpr, CHUNK: tl.constexpr, VSPLIT: tl.constexpr,
                        HB: tl.constexpr, CS: tl.constexpr):
    """Program (row, head group, column group): HB heads × CS V columns (CS ≤ C / VSPLIT, so one
    V split's m, l) of one row; folds the row's chunk partials in chunk order. Every operation
    is elementwise over (head, column), so HB and CS do not change a bit."""
    i = tl.program_id(0)
    hd = tl.program_id(1) * HB + tl.arange(0, HB)[:, None]                   # [HB, 1]
    c0 = tl.program_id(2) * CS
    cc = c0 + tl.arange(0, CS)[None, :]                                      # [1, CS]
    vh = c0 // (C // VSPLIT)
    n = tl.load(pos_ptr + i) // CHUNK + 1
    M = tl.full((HB, 1), -1.0e30, tl.float32)
    S = tl.full((HB, 1), 0.0, tl.float32)
    O = tl.zeros((HB, CS), tl.float32)
    for c in tl.range(0, n, num_stages=3):  # chunk order: fixed by the row's own position (loads pipelined)
        m_c = tl.load(pm_ptr + ((i * NCH + c) * VSPLIT + vh) * H + hd)           # [HB, 1]
        l_c = tl.load(pl_ptr + ((i * NCH + c) * VSPLIT + vh) * H + hd)
        a_c = tl.load(pacc_ptr + ((i * NCH + c) * H + hd) * C + cc)              # [HB, CS]
        M_new = tl.maximum(M, m_c)
        a = tl.exp2(M - M_new)
        b = tl.exp2(m_c - M_new)
        S = S * a + l_c * b
        O = O * a + a_c * b
        M = M_new
    tl.store(o_ptr + i * so_row + hd * C + cc, (O / S).to(o_ptr.dtype.element_ty))


def combine_grid(T: int, h: int, C: int, vsplit: int, device, rows: bool | None = None) -> tuple[int, int, int]:
    """The combine launch's (heads per program, columns per program, warps): ``rows`` True: one
    program per row (all heads, a V split's columns, 4 warps); False: one 1-warp program per (row,
    head, 128 columns), so a few rows' chunk folds run in parallel (H200 session 15, 32768/8/1: 10.8
    µs per row, 3.6 per head and columns); None: per row from ``COMBINE_ROWS_PER_SM`` rows per SM."""
    if rows is None:
        rows = device.type != "cuda" or T >= COMBINE_ROWS_PER_SM * _sm_count(device)
    return (h, C // vsplit, COMBINE_WARPS) if rows else (1, min(C // vsplit, 128), 1)


@functools.cache
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def make_tiles(seqs: list[tuple[int, int, int, int]], block_r: int, device) -> torch.Tensor:
    """Tile table [n_tiles, 4] int64 (first row, rows, base, L) from per-request
    (row_start, n_rows, base, L); a tile never spans two requests."""
    tiles = [(r0 + k, min(block_r, n - k), base, L) for r0, n, base, L in seqs for k in range(0, n, block_r)]
    return torch.tensor(tiles, dtype=torch.int64, device=device).view(-1, 4)


def tiles_from_rows(row_meta: torch.Tensor, block_r: int) -> torch.Tensor:
    """``make_tiles`` on the device, without a host sync (a CUDA graph's inputs): row_meta [R, 2]
    int64 = (base, L) per row, a request's rows consecutive (rows of one request = a run of equal
    (base, L), as ``modeling.graphs.TreeInputs`` lays out trees and padding). Returns [R, 4] int64:
    the same tiles as ``make_tiles`` of those runs, in order, then unused tiles (0 rows, base 0, L 0)."""
    R = row_meta.shape[0]
    i = torch.arange(R, device=row_meta.device)
    first = torch.ones(R, dtype=torch.bool, device=row_meta.device)
    first[1:] = (row_meta[1:] != row_meta[:-1]).any(1)                  # a request's first row
    run0 = torch.where(first, i, 0).cummax(0).values                     # its run's first row
    run_end = torch.zeros(R + 1, dtype=torch.int64, device=row_meta.device)
    run_end.scatter_reduce_(0, run0, i + 1, "amax", include_self=True)   # … and end, at the run's first row
    off = i - run0
    start = off % block_r == 0                                           # a tile begins here
    order = torch.argsort((~start).to(torch.int8), stable=True)           # tile starts first, in row order
    r0 = order
    live = start[order]
    rows = torch.where(live, torch.minimum(run_end[run0[order]] - r0, torch.full_like(r0, block_r)), 0)
    # unused tiles: no rows and L 0, so that their programs fold nothing
    return torch.stack([r0, rows, torch.where(live, row_meta[order, 0], 0), torch.where(live, row_meta[order, 1], 0)],
                       1).contiguous()


def default_block_r(h: int) -> int:
    """Rows per tile: M = BLOCK_R·h = 64 query rows of every dot (one Hopper warpgroup MMA tile);
    at most 32 tree rows (one head per rank, e.g. a TP split of a small model: M = 32)."""
    return min(32, max(1, 64 // h))


def use_tma(kv: torch.Tensor) -> bool:
    """Whether prefix blocks can come by TMA (Hopper tensor-memory-access) loads: a CUDA device
    of compute capability ≥ 9 and latent rows at 16-byte aligned addresses (a property of the
    pool, so fixed per deployment)."""
    return (kv.is_cuda and torch.cuda.get_device_capability(kv.device)[0] >= 9 and kv.stride(-1) == 1
            and kv.data_ptr() % 16 == 0 and kv.stride(0) * kv.element_size() % 16 == 0)


def mla_attention(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor,
                  seqs: list[tuple[int, int, int, int]], scale: float, kv_lora_rank: int,
                  max_positions: int | None = None, block_r: int | None = None, bn: int = BLOCK_N,
                  chunk: int = CHUNK, num_warps: int | None = None, num_stages: int = 2, tma: bool | None = None,
                  tiles: torch.Tensor | None = None, vsplit: int = VSPLIT, tail_stages: int = TAIL_STAGES,
                  tail_warps: int | None = None, prefix: str | None = None, partials: bool = False,
                  tail_rows: bool | None = None, tail_m: int | None = None, combine_rows: bool | None = None,
                  pages: torch.Tensor | None = None, page_rows: int = 128, max_tree_rows: int | None = None):
    """Absorbed MLA tree attention.

    q [T, h, C + R] (q_nope·W_UK ‖ roped q_pe), kv [rows, C + R] one layer of the latent pool
    (c ‖ k_pe; the tree's own rows already written at base + L + j), positions [T] int64
    (= L + depth), ancestors [T, W] int32 (tree row of the row's ancestor at depth j, itself at
    its depth), seqs: per request (first row, rows, base, L) with its rows contiguous in q;
    scale: the softmax scale (mscale² / sqrt(qk_head_dim) for DeepSeek-V3 — never 1/sqrt(C+R));
    kv_lora_rank: C. max_positions: an upper bound of max(positions) + 1 (sizes the chunk
    grid; read from the device when None). Returns o_lat [T, h, C] in q.dtype (apply W_UV).
    h must be a power of two, C and R powers of two ≥ 16; float32 inputs use IEEE products.
    block_r, bn, chunk and vsplit (1 or 2: programs per tile and chunk, each owning C / vsplit
    of the V columns and summing its own columns' scores first) fix the arithmetic: fix them
    per deployment (the defaults are the H200 sweep's best at Kimi-K2 TP8 shapes,
    bench/results/mla_kernel_h200.md, with chunk 2048 from mla_kernel_h200_chunk2048_s13.md).
    num_warps (None: 8 for vsplit 1, 4 for vsplit 2), num_stages, tail_stages (pipelining of the
    tree blocks' gathers), tail_warps (warps of the tree-block launch; None: see tail_m) and tma
    (prefix blocks by TMA loads; None: ``use_tma(kv)``) do not change results (tail_warps ≠
    num_warps relies on an MMA's element not depending on the instruction's N: the bench's
    crossing invariance check tests it). tiles: a prebuilt ``make_tiles`` table, for CUDA graphs.
    prefix: which launch folds the committed-prefix blocks — "triton" (``_mla_chunk_kernel``),
    "gluon" (specdec_kernels/mla_prefix.py: Hopper, the score tile computed once; the same bits) or "auto"
    (gluon where it supports the inputs); None: the module's PREFIX. With the Gluon launch, num_warps,
    num_stages and tma tune only the Triton tree-block launch. partials: return the fp32 chunk
    partials (m, l [T, nch, vsplit, h], acc [T, nch, h, C]; written for chunks up to the tile's
    deepest position) instead of the output — tests compare launches through them bit for bit.
    tail_rows: the tree-block launch runs one program per tree row (its own leader) instead of one
    per tile (leaders serving several rows): more parallel, more MMA work, the same bits for finite
    latents (a per-tile leader's deeper keys reach its ancestors' rows as exact zeros of P times the
    key, so an inf latent there turns them NaN; per row they are never loaded); None: per row where
    that is at most ``TAIL_ROWS_PER_SM`` programs per SM (small batches). tail_m: rows of the tree-block
    launch's dots (a power of two, 16 ≤ tail_m ≤ block_r·h, ≥ h; None: block_r·h): a program then folds
    tail_m // h rows (per tile: leaders among them) or, per row, one row in dots of tail_m rows — fewer
    MMA rows wasted on leaders serving few rows, more programs; the same bits where an MMA's element
    does not depend on the instruction's M (below 64 rows Hopper runs mma.sync, not wgmma: equal at
    48 of 48 bench shapes and in the GPU tests on the H200, session 15). None: ``TAIL_M`` rows, at least
    one row (h), at most block_r·h. tail_warps None: ``TAIL_WARPS`` below 64 rows, else num_warps.
    combine_rows: the combine launch one program per row (True) or per (row, head, 128 columns)
    (False); None: by the number of rows (``combine_grid``). Elementwise: the same bits either way.
    pages: a paged latent pool — pages [n] int32/int64, the requests' page tables one after another;
    a request's ``base`` in seqs is then its table's offset in pages, and its logical row r (position
    p < L, or L + tree node j) lives at pool row ``pages[base + r // page_rows] · page_rows +
    r % page_rows`` (page_rows a multiple of bn: a key block never straddles a page). The same rows
    reach the same arithmetic: bit for bit the contiguous layout's result, with either prefix launch
    (the Gluon one looks each block's page up once and TMA-loads it as one block).
    max_tree_rows: with ``tiles`` (and then seqs may be None): a bound of any request's rows, so that
    no host value of the batch is needed (a CUDA graph's fixed launch; ``tiles_from_rows``).
    Raises ValueError for unsupported shapes or knobs.
    """
    T, h, D = q.shape
    C, R = kv_lora_rank, D - kv_lora_rank
    if prefix is None:
        prefix = PREFIX
    if prefix not in ("triton", "gluon", "auto"):
        raise ValueError(f"prefix {prefix!r} must be 'triton', 'gluon' or 'auto'")
    if h & (h - 1) or C & (C - 1) or R & (R - 1) or min(C, R) < 16 or kv.shape[-1] != D:
        raise ValueError(f"need power-of-two heads and C, R >= 16 with kv width C + R; got h={h}, C={C}, "
                         f"R={R}, kv width {kv.shape[-1]}")
    if vsplit not in (1, 2):
        raise ValueError(f"vsplit {vsplit} must be 1 or 2")
    if bn < 16 or bn & (bn - 1) or chunk % bn:
        raise ValueError(f"block {bn} must be a power of two >= 16 dividing the chunk {chunk}")
    block_r = block_r or default_block_r(h)
    if block_r * h < 16 or block_r & (block_r - 1) or block_r > 32:
        raise ValueError(f"block_r {block_r} must be a power of two <= 32 with block_r·h >= 16 (tl.dot)")
    if tail_m is None:
        tail_m = min(block_r * h, max(TAIL_M, h))
    if type(tail_m) is not int or tail_m & (tail_m - 1) or not max(16, h) <= tail_m <= block_r * h:
        raise ValueError(f"tail_m {tail_m!r} must be a power-of-two int with max(16, h) <= tail_m <= block_r·h "
                         f"({block_r * h})")
    if tail_warps is not None and (type(tail_warps) is not int or tail_warps < 1 or tail_warps & (tail_warps - 1)):
        raise ValueError(f"tail_warps {tail_warps!r} must be a power-of-two int >= 1 (or None)")
    if pages is not None:
        if page_rows < bn or page_rows % bn:
            raise ValueError(f"page_rows {page_rows} must be a positive multiple of the block {bn}")
    if prefix != "triton":
        try:
            from specdec_kernels import mla_prefix
            why = mla_prefix.unsupported(q, kv, C, block_r, bn, vsplit)
        except ImportError as e:  # a Triton without Gluon's Hopper API
            why = f"this Triton has no Gluon Hopper API ({e})"
        if prefix == "gluon" and why:
            raise ValueError("prefix 'gluon' needs bf16 on a compute-capability-9 GPU, h·block_r = 64, C 512, "
                             f"R 64, bn 64, vsplit 1; here {why}")
        prefix = "triton" if why else "gluon"
    if tiles is None:
        tiles = make_tiles(seqs, block_r, q.device)
    if max_positions is None:
        max_positions = int(positions.max()) + 1
    nch = -(-max_positions // chunk)
    if num_warps is None:
        num_warps = 8 if vsplit == 1 else 4
    pm = torch.empty(T, nch, vsplit, h, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(T, nch, h, C, device=q.device, dtype=torch.float32)
    if tma is None:
        tma = use_tma(kv)
    if tma:  # device-side descriptors live in a per-launch scratch buffer
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=q.device))
    n_max = max_tree_rows if seqs is None else max((n for _, n, _, _ in seqs), default=1)
    if n_max is None:
        raise ValueError("without seqs, pass tiles and max_tree_rows")
    n_tail = (bn + n_max - 2) // chunk + 2  # chunks holding tree keys: ⌊L/BN⌋·BN … < ⌊L/BN⌋·BN + BN + n
    qk_scale = scale * math.log2(math.e)
    args = (q, kv, pm, pl, pacc, positions, ancestors, tiles, tiles if pages is None else pages, q.stride(0),
            q.stride(1), kv.stride(0), ancestors.stride(0), qk_scale, nch, kv.shape[0])
    meta = dict(H=h, BLOCK_R=block_r, C=C, R=R, BN=bn, CHUNK=chunk, IEEE=q.dtype == torch.float32,
                VSPLIT=vsplit, num_warps=num_warps, PAGED=pages is not None, PR=page_rows)
    key = (q.dtype, h, C, R, block_r, bn, chunk, num_warps, num_stages, bool(tma), vsplit, tail_stages, tail_warps,
           pages is not None, page_rows)
    grid0 = tiles.shape[0] * vsplit
    if prefix == "gluon":
        mla_prefix.prefix_partials(q, kv, pm, pl, pacc, positions, tiles, qk_scale, nch, h, block_r, chunk, C,
                                   pages=pages, page_rows=page_rows)
    else:
        stages = _FITS.get(key, num_stages)
        while True:  # fewer pipeline stages when shared memory is short (results do not change)
            try:
                _mla_chunk_kernel[(grid0, nch)](*args, STAGES=stages, TAIL=False, TMA=bool(tma),
                                                num_stages=stages, **meta)
                break
            except OutOfResources:
                if stages <= 1:
                    raise
                stages -= 1
        _FITS[key] = stages
    if tail_rows is None:
        tail_rows = q.is_cuda and grid0 * block_r <= TAIL_ROWS_PER_SM * _sm_count(q.device)
    sub = 1 if tail_rows else tail_m // h  # rows per tree-launch program
    tkey = key + ("tail", sub, tail_m)
    tst = _FITS.get(tkey, tail_stages)
    while True:
        try:
            _mla_chunk_kernel[(grid0 * (block_r // sub), n_tail)](
                *args, STAGES=1, TAIL=True, TMA=False, TSTAGES=tst, num_stages=1, SUB=sub, TM=tail_m,
                **dict(meta, num_warps=tail_warps or (TAIL_WARPS if tail_m < 64 else num_warps)))
            break
        except OutOfResources:
            if tst <= 1:
                raise
            tst -= 1
    _FITS[tkey] = tst
    if partials:
        return pm, pl, pacc
    out = torch.empty(T, h, C, device=q.device, dtype=q.dtype)
    hb, cs, warps = combine_grid(T, h, C, vsplit, q.device, combine_rows)
    _mla_combine_kernel[(T, h // hb, C // cs)](pm, pl, pacc, positions, out, out.stride(0), nch, H=h, C=C, CHUNK=chunk,
                                               VSPLIT=vsplit, HB=hb, CS=cs, num_warps=warps)
    return out


def mla_attention_reference(q, kv, positions, ancestors, seqs, scale, kv_lora_rank, pages=None,
                            page_rows: int = 128) -> torch.Tensor:
    """float64 reference: gathers each row's visible latent rows explicitly (same arguments as
    ``mla_attention``); returns [T, h, C] float64."""
    T, h, D = q.shape
    out = torch.empty(T, h, kv_lora_rank, dtype=torch.float64, device=q.device)
    table = None if pages is None else pages.tolist()
    for r0, n, base, L in seqs:
        def row(r):  # pool row of the request's logical row r
            return base + r if table is None else table[base + r // page_rows] * page_rows + r % page_rows

        for i in range(r0, r0 + n):
            P = int(positions[i])
            slots = [row(p) if p < L else row(L + int(ancestors[i, p - L])) for p in range(P + 1)]
            k = kv[slots].double()                                               # [S, C + R]
            s = q[i].double() @ k.T * scale                                      # [h, S]
            out[i] = s.softmax(-1) @ k[:, :kv_lora_rank]
    return out
