"""Absorbed MLA attention for tree verify over the MLA latent cache (DeepSeek-V2/V3 MLA with W_UK
folded into the query; plans/0007-mla-tp.md), row-invariant as ``kernels/tree_attention.py``.

Per query row i (tree node at depth δ_i of a request with L committed rows, absolute position
P_i = L + δ_i) and head: scores against the latent rows c ‖ k_pe (C + R values, one "KV head"
shared by all heads) at positions 0…P_i, softmax with an explicit scale, output the
probability-weighted latent (V = the first C values of each row). Position p < L reads pool
row ``base + p``; position L + j reads i's ancestor at depth j (``base + L + anc[i, j]``).

Order of the reduction (what makes it row-invariant): positions are cut into chunks of CHUNK
and blocks of BN, both aligned to absolute position 0. A program owns one tile of up to
BLOCK_R consecutive query rows of one request × all heads (M = BLOCK_R·h rows of every dot)
and one chunk. Blocks wholly below ⌊L/BN⌋·BN are read once for the tile (the bytes of a long
prefix); the tail blocks are gathered per row, with the same M×BN dot, keeping that row's
results only. Partials (max, sum, acc) per (row, chunk) are then combined in chunk order by a
second kernel. A row's arithmetic thus depends only on its own position and keys: a node at
depth δ gives bit for bit what a one-row decode at L + δ gives after its path is committed.
Optionally (v_split) the V columns are split over programs, each recomputing the scores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32      # key positions per block
CHUNK = 1024      # key positions per split (partials are combined in chunk order)


@triton.jit
def _scores(qa, cc, dr, ok, q_c, q_r, kc, kr, C: tl.constexpr, Q_RELOAD: tl.constexpr, IEEE: tl.constexpr):
    """q·kᵀ over the latent and rope parts, [BM, BN] fp32 (unscaled). Q_RELOAD: read q from
    memory (L1/L2) here instead of holding it in registers across the key loop."""
    if Q_RELOAD:
        q_c = tl.load(qa + cc[None, :], mask=ok[:, None], other=0.0)
        q_r = tl.load(qa + C + dr[None, :], mask=ok[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q_c, tl.trans(kc), input_precision="ieee") + tl.dot(q_r, tl.trans(kr), input_precision="ieee")
    else:
        s = tl.dot(q_c, tl.trans(kc)) + tl.dot(q_r, tl.trans(kr))
    return s


@triton.jit
def _mla_chunk_kernel(q_ptr, kv_ptr, pm_ptr, pl_ptr, pacc_ptr, pos_ptr, anc_ptr, tile_ptr,
                      sq_row, sq_head, skv_row, s_anc, scale,
                      H: tl.constexpr, BLOCK_R: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                      BN: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr, Q_RELOAD: tl.constexpr,
                      VS: tl.constexpr):
    t = tl.program_id(0)
    ch = tl.program_id(1) // VS       # chunk
    vs = tl.program_id(1) % VS        # slice of the V (latent) columns this program accumulates
    NCH = tl.num_programs(1) // VS
    CV: tl.constexpr = C // VS
    r0 = tl.load(tile_ptr + t * 4)
    nr = tl.load(tile_ptr + t * 4 + 1)
    base = tl.load(tile_ptr + t * 4 + 2)
    L = tl.load(tile_ptr + t * 4 + 3)
    BM: tl.constexpr = BLOCK_R * H
    mm = tl.arange(0, BM)
    rr = mm // H                       # row of the tile
    hh = mm % H                        # head
    ok = rr < nr
    row = r0 + rr
    rows = tl.arange(0, BLOCK_R)
    pos_r = tl.load(pos_ptr + r0 + rows, mask=rows < nr, other=-1)
    p_max = tl.max(pos_r, axis=0)
    cs = ch * CHUNK
    if cs <= p_max:
        cc = tl.arange(0, C)
        dr = tl.arange(0, R)
        cv = vs * CV + tl.arange(0, CV)
        qa = q_ptr + row[:, None] * sq_row + hh[:, None] * sq_head
        if Q_RELOAD:
            q_c = tl.zeros((BM, C), q_ptr.dtype.element_ty)  # unused: _scores reads q itself
            q_r = tl.zeros((BM, R), q_ptr.dtype.element_ty)
        else:
            q_c = tl.load(qa + cc[None, :], mask=ok[:, None], other=0.0)       # [BM, C]
            q_r = tl.load(qa + C + dr[None, :], mask=ok[:, None], other=0.0)   # [BM, R]
        m = tl.full((BM,), float("-inf"), tl.float32)
        l = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, CV), tl.float32)
        L0 = (L // BN) * BN
        shared_end = tl.minimum(cs + CHUNK, L0)
        for start in range(cs, shared_end, BN):  # prefix blocks: one load for the whole tile
            slot = base + start + tl.arange(0, BN)
            kc = tl.load(kv_ptr + slot[:, None] * skv_row + cc[None, :])       # [BN, C]
            kr = tl.load(kv_ptr + slot[:, None] * skv_row + C + dr[None, :])   # [BN, R]
            s = _scores(qa, cc, dr, ok, q_c, q_r, kc, kr, C, Q_RELOAD, IEEE) * scale
            if VS == 1:
                vc = kc
            else:
                vc = tl.load(kv_ptr + slot[:, None] * skv_row + cv[None, :])      # [BN, CV]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc)
            m = m_new
        tail_end = tl.minimum(cs + CHUNK, p_max + 1)
        for start in range(tl.maximum(cs, L0), tail_end, BN):  # per-row keys (prefix tail + ancestors)
            for j in range(0, nr):
                pos_j = tl.load(pos_ptr + r0 + j)
                if start <= pos_j:
                    p_abs = start + tl.arange(0, BN)
                    valid = p_abs <= pos_j
                    in_tree = p_abs >= L
                    node = tl.load(anc_ptr + (r0 + j) * s_anc + tl.where(in_tree, p_abs - L, 0),
                                   mask=valid & in_tree, other=0)
                    slot = base + tl.where(in_tree, L + node, p_abs)
                    kc = tl.load(kv_ptr + slot[:, None] * skv_row + cc[None, :], mask=valid[:, None], other=0.0)
                    kr = tl.load(kv_ptr + slot[:, None] * skv_row + C + dr[None, :], mask=valid[:, None], other=0.0)
                    s = _scores(qa, cc, dr, ok, q_c, q_r, kc, kr, C, Q_RELOAD, IEEE) * scale
                    if VS == 1:
                        vc = kc
                    else:
                        vc = tl.load(kv_ptr + slot[:, None] * skv_row + cv[None, :], mask=valid[:, None], other=0.0)
                    sel = rr == j
                    s = tl.where(valid[None, :], s, float("-inf"))
                    m_new = tl.maximum(m, tl.max(s, axis=1))
                    alpha = tl.where(sel, tl.exp(m - m_new), 1.0)
                    p = tl.where(sel[:, None], tl.exp(s - m_new[:, None]), 0.0)
                    l = tl.where(sel, l * alpha + tl.sum(p, axis=1), l)
                    if IEEE:
                        upd = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc, input_precision="ieee")
                    else:
                        upd = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc)
                    acc = tl.where(sel[:, None], upd, acc)
                    m = tl.where(sel, m_new, m)
        part = row * NCH + ch                                                   # [BM]
        tl.store(pm_ptr + part * H + hh, m, mask=ok & (vs == 0))  # every slice has the same m, l
        tl.store(pl_ptr + part * H + hh, l, mask=ok & (vs == 0))
        tl.store(pacc_ptr + (part * H + hh)[:, None] * C + cv[None, :], acc, mask=ok[:, None])


@triton.jit
def _mla_combine_kernel(pm_ptr, pl_ptr, pacc_ptr, pos_ptr, o_ptr, so_row, NCH,
                        H: tl.constexpr, BH: tl.constexpr, C: tl.constexpr, CHUNK: tl.constexpr,
                        VS: tl.constexpr):
    i = tl.program_id(0)
    hh = tl.arange(0, BH)
    hm = hh < H
    cc = tl.program_id(1) * (C // VS) + tl.arange(0, C // VS)
    n = tl.load(pos_ptr + i) // CHUNK + 1
    M = tl.full((BH,), float("-inf"), tl.float32)
    S = tl.zeros((BH,), tl.float32)
    O = tl.zeros((BH, C // VS), tl.float32)
    for c in range(0, n):  # chunk order: fixed by the row's own position
        part = (i * NCH + c) * H + hh
        m_c = tl.load(pm_ptr + part, mask=hm, other=0.0)
        l_c = tl.load(pl_ptr + part, mask=hm, other=0.0)
        a_c = tl.load(pacc_ptr + part[:, None] * C + cc[None, :], mask=hm[:, None], other=0.0)
        M_new = tl.maximum(M, m_c)
        a = tl.exp(M - M_new)
        b = tl.exp(m_c - M_new)
        S = S * a + l_c * b
        O = O * a[:, None] + a_c * b[:, None]
        M = M_new
    out = O / S[:, None]
    tl.store(o_ptr + i * so_row + hh[:, None] * C + cc[None, :], out.to(o_ptr.dtype.element_ty), mask=hm[:, None])


def make_tiles(seqs: list[tuple[int, int, int, int]], block_r: int, device) -> torch.Tensor:
    """Tile table [n_tiles, 4] int64 (first row, rows, base, L) from per-request
    (row_start, n_rows, base, L); a tile never spans two requests."""
    tiles = [(r0 + k, min(block_r, n - k), base, L) for r0, n, base, L in seqs for k in range(0, n, block_r)]
    return torch.tensor(tiles, dtype=torch.int64, device=device).view(-1, 4)


def default_block_r(h: int) -> int:
    """Rows per tile: M = BLOCK_R·h = 32 query rows of the dot (≥ 16 for tl.dot)."""
    return max(1, 32 // h)


def mla_attention(q: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, ancestors: torch.Tensor,
                  seqs: list[tuple[int, int, int, int]], scale: float, kv_lora_rank: int,
                  max_positions: int | None = None, block_r: int | None = None, bn: int = BLOCK_N,
                  chunk: int = CHUNK, num_warps: int = 4, num_stages: int = 2, q_reload: bool = False,
                  v_split: int = 1, tiles: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed MLA tree attention.

    q [T, h, C + R] (q_nope·W_UK ‖ roped q_pe), kv [rows, C + R] one layer of the latent pool
    (c ‖ k_pe; the tree's own rows already written at base + L + j), positions [T] int64
    (= L + depth), ancestors [T, W] int32 (tree row of the row's ancestor at depth j, itself at
    its depth), seqs: per request (first row, rows, base, L) with its rows contiguous in q;
    scale: the softmax scale (mscale² / sqrt(qk_head_dim) for DeepSeek-V3 — never 1/sqrt(C+R));
    kv_lora_rank: C. max_positions: an upper bound of max(positions) + 1 (sizes the chunk
    grid; read from the device when None). Returns o_lat [T, h, C] in q.dtype (apply W_UV).
    h must be a power of two, C and R powers of two ≥ 16; float32 inputs use IEEE products.
    The tiling knobs (block_r, bn, chunk, v_split) may change the rounding: fix them per
    deployment (num_warps, num_stages and q_reload do not change results; tiles: a prebuilt
    ``make_tiles`` table, for CUDA graphs). v_split: programs per (tile, chunk), each
    accumulating C / v_split of the V columns (scores recomputed by each: fewer registers per
    program and more programs, at the price of repeating q·kᵀ).
    """
    T, h, D = q.shape
    C, R = kv_lora_rank, D - kv_lora_rank
    if h & (h - 1) or C & (C - 1) or R & (R - 1) or min(C, R) < 16 or kv.shape[-1] != D:
        raise ValueError(f"need power-of-two heads and C, R >= 16 with kv width C + R; got h={h}, C={C}, "
                         f"R={R}, kv width {kv.shape[-1]}")
    if chunk % bn:
        raise ValueError(f"chunk {chunk} must be a multiple of the block {bn}")
    block_r = block_r or default_block_r(h)
    if block_r * h < 16:
        raise ValueError(f"block_r·h = {block_r * h} must be >= 16 (tl.dot)")
    if tiles is None:
        tiles = make_tiles(seqs, block_r, q.device)
    if max_positions is None:
        max_positions = int(positions.max()) + 1
    nch = -(-max_positions // chunk)
    pm = torch.empty(T, nch, h, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(T, nch, h, C, device=q.device, dtype=torch.float32)
    ieee = q.dtype == torch.float32
    if C % v_split or (C // v_split) < 16 or v_split & (v_split - 1):
        raise ValueError(f"v_split {v_split} must be a power of two leaving >= 16 of C={C} columns per slice")
    _mla_chunk_kernel[(tiles.shape[0], nch * v_split)](
        q, kv, pm, pl, pacc, positions, ancestors, tiles, q.stride(0), q.stride(1), kv.stride(0),
        ancestors.stride(0), scale, H=h, BLOCK_R=block_r, C=C, R=R, BN=bn, CHUNK=chunk, IEEE=ieee,
        Q_RELOAD=q_reload, VS=v_split, num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(T, h, C, device=q.device, dtype=q.dtype)
    _mla_combine_kernel[(T, v_split)](pm, pl, pacc, positions, out, out.stride(0), nch, H=h,
                                      BH=triton.next_power_of_2(h), C=C, CHUNK=chunk, VS=v_split, num_warps=4)
    return out


def mla_attention_reference(q, kv, positions, ancestors, seqs, scale, kv_lora_rank) -> torch.Tensor:
    """float64 reference: gathers each row's visible latent rows explicitly (same arguments as
    ``mla_attention``); returns [T, h, C] float64."""
    T, h, D = q.shape
    out = torch.empty(T, h, kv_lora_rank, dtype=torch.float64, device=q.device)
    for r0, n, base, L in seqs:
        for i in range(r0, r0 + n):
            P = int(positions[i])
            slots = [base + p if p < L else base + L + int(ancestors[i, p - L]) for p in range(P + 1)]
            k = kv[slots].double()                                               # [S, C + R]
            s = q[i].double() @ k.T * scale                                      # [h, S]
            out[i] = s.softmax(-1) @ k[:, :kv_lora_rank]
    return out
