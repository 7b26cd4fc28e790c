"""Tree attention over a KV pool, reducing each query row over its visible keys in
absolute-position order (DDTree/SpecInfer tree verify; shared DOMAIN notes §3, §8).

Query row i (a tree node at depth δ_i, absolute position P_i = L + δ_i) sees the keys at
positions 0…P_i: positions < L are the request's committed rows (pool row ``base + p``);
position L + j is i's ancestor at depth j, a row of this forward (pool row
``base + L + anc[i, j]``). The kernel walks those positions in blocks aligned to absolute
positions (0, BLOCK_N, 2·BLOCK_N, …) with an online softmax, so a node sees bit for bit the
same key sequence, in the same blocks, as a one-row decode at position P_i would after its
ancestors were committed. One program per (query row, KV head) holds that head's group of
query heads, so nothing depends on the number of rows in the launch.

Paged pool (issue 14, plans/0009 §3): with ``pages`` given, a request's rows live in fixed-size
pages of ``page_rows`` rows anywhere in the pool; the row's ``base`` is then the offset of its
page table in ``pages``, and the key stored at request position s (s = p for a committed key,
L + anc for a tree key) is pool row ``pages[base + s // page_rows] · page_rows + s % page_rows``.
Only the addresses change: the blocks, their order and every product are the same, so a row's
result is bitwise the contiguous layout's.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Keys per block (a block starts at a multiple of BLOCK_N in absolute position) and warps per
# program: fixed for every launch, so row invariance holds. Chosen on the H200 by
# bench/kernel_tiles.py (128, 4: 5.7 µs at 1 row over 300 keys vs 8.4 for 64, 4); SPECDEC_ATTN_TILES="BLOCK_N,warps" overrides both (sweeps only).
BLOCK_N, NUM_WARPS = (int(v) for v in os.environ.get("SPECDEC_ATTN_TILES", "128,4").split(","))


@triton.jit
def _tree_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, anc_ptr, meta_ptr, row_meta_ptr, pages_ptr,
                      sq_row, sq_head, sk_row, sk_head, so_row, scale,
                      GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                      IEEE: tl.constexpr, ROW_META: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    if ROW_META:  # one request per row: its own (base, L)
        base = tl.load(row_meta_ptr + 2 * i)
        L = tl.load(row_meta_ptr + 2 * i + 1)
    else:
        base = tl.load(meta_ptr)
        L = tl.load(meta_ptr + 1)
    s_anc = tl.load(meta_ptr + 2)
    pos_i = tl.load(pos_ptr + i)
    g = tl.arange(0, BLOCK_G)
    gm = g < GROUP
    dd = tl.arange(0, D)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + i * sq_row + heads[:, None] * sq_head + dd[None, :], mask=gm[:, None], other=0.0)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    for start in range(0, pos_i + 1, BN):
        p = start + tl.arange(0, BN)
        valid = p <= pos_i
        in_tree = p >= L
        depth = tl.where(in_tree, p - L, 0)
        node = tl.load(anc_ptr + i * s_anc + depth, mask=valid & in_tree, other=0)
        if PAGED:  # request position → its page (a table entry, cached) → pool row
            sp = tl.where(in_tree, L + node, p)
            page = tl.load(pages_ptr + base + sp // PAGE, mask=valid, other=0)
            slot = page * PAGE + sp % PAGE
        else:
            slot = base + tl.where(in_tree, L + node, p)
        k = tl.load(k_ptr + slot[None, :] * sk_row + kvh * sk_head + dd[:, None], mask=valid[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        pr = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(pr, axis=1)
        v = tl.load(v_ptr + slot[:, None] * sk_row + kvh * sk_head + dd[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m = m_new
    out = acc / l[:, None]
    tl.store(o_ptr + i * so_row + heads[:, None] * D + dd[None, :], out.to(o_ptr.dtype.element_ty), mask=gm[:, None])


def tree_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, positions: torch.Tensor,
                   ancestors: torch.Tensor, meta: torch.Tensor, row_meta: torch.Tensor | None = None,
                   pages: torch.Tensor | None = None, page_rows: int = 128,
                   tiles: tuple[int, int] | None = None) -> torch.Tensor:
    """q [T, h, d]; k_pool/v_pool [rows, g, d] (one layer of the pool, the tree's own rows
    already written at ``base + L + j``); positions [T] int64 (= L + depth, the last visible
    position); ancestors flat int32/int64 with row stride W (``ancestors[i·W + j]`` = tree row of
    i's ancestor at depth j, for j ≤ depth_i); meta [3] int64 = (base, L, W) on the device (so a
    CUDA graph replays with any request, prefix and tree depth). ``row_meta`` [T, 2] int64 on
    the device (optional; contiguous): (base, L) per query row, replacing meta[0] / meta[1] for
    that row, so rows of several requests share one launch (each row's ancestor entries stay
    local to its own tree: slot = base_row + L_row + anc; meta[2] = W is still read). A row's
    result does not depend on the other rows, whichever requests they belong to.
    ``pages`` (optional; int64 on the device): page tables of a paged pool, flat; each row's
    base (meta[0], or its row_meta entry) is then the offset of its request's table in ``pages`` and key
    position s of the request is pool row pages[base + s // page_rows]·page_rows + s % page_rows
    (``page_rows`` ≥ 1, any value; the serving pool uses 128 = BLOCK_N). Bitwise the same
    result as the contiguous layout holding the same K/V.
    Returns [T, h·d] in q.dtype.
    Scale d^-½; float32 inputs use IEEE products (no TF32). ``tiles`` = (BLOCK_N, warps)
    overrides the module's fixed choice (sweeps only).
    Graph-safe: no host reads."""
    T, h, d = q.shape
    g = k_pool.shape[1]
    out = torch.empty(T, h * d, device=q.device, dtype=q.dtype)
    group = h // g
    bn, warps = tiles or (BLOCK_N, NUM_WARPS)
    if row_meta is not None:
        assert row_meta.dtype == torch.int64 and row_meta.is_contiguous() and row_meta.shape[0] >= T, \
            "row_meta must be a contiguous [T, 2] int64 tensor"
    assert pages is None or pages.dtype == torch.int64, "pages must be an int64 tensor"
    _tree_attn_kernel[(T, g)](q, k_pool, v_pool, out, positions, ancestors, meta,
                              meta if row_meta is None else row_meta, meta if pages is None else pages,
                              q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), out.stride(0),
                              d ** -0.5, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
                              D=d, BN=bn, IEEE=q.dtype == torch.float32, ROW_META=row_meta is not None,
                              PAGED=pages is not None, PAGE=page_rows, num_warps=warps)
    return out


def tree_attention_reference(q, k_pool, v_pool, positions, ancestors, meta, row_meta=None, pages=None,
                             page_rows: int = 128) -> torch.Tensor:
    """float64 reference: gathers each row's visible keys explicitly and runs softmax attention
    (``row_meta``, ``pages`` as in ``tree_attention``)."""
    T, h, d = q.shape
    g = k_pool.shape[1]
    base, L, w = (int(x) for x in meta.tolist())
    ancestors = ancestors.reshape(-1)[:T * w].view(T, w)
    out = torch.empty(T, h * d, dtype=torch.float64, device=q.device)
    for i in range(T):
        if row_meta is not None:
            base, L = (int(x) for x in row_meta[i].tolist())
        P = int(positions[i])
        slots = [p if p < L else L + int(ancestors[i, p - L]) for p in range(P + 1)]
        if pages is None:
            slots = [base + s for s in slots]
        else:
            slots = [int(pages[base + s // page_rows]) * page_rows + s % page_rows for s in slots]
        k = k_pool[slots].double().repeat_interleave(h // g, 1)  # [S, h, d]
        v = v_pool[slots].double().repeat_interleave(h // g, 1)
        s = torch.einsum("hd,shd->hs", q[i].double(), k) * d ** -0.5
        out[i] = torch.einsum("hs,shd->hd", s.softmax(-1), v).reshape(-1)
    return out
