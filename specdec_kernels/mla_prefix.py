"""Prefix-chunk launch of the absorbed MLA tree attention, in Gluon for Hopper (sm_90), with each
score tile computed once (plans/0007-mla-tp.md, "Session 12").

What it replaces: the first of ``specdec_kernels/mla_attention.py``'s launches (``_mla_chunk_kernel``
with TAIL=False), which folds a tile's chunk of committed-prefix blocks into fp32 partials
(m, l, acc). That launch holds ~85 % of the time at the large Kimi-K2 shapes, and Triton's
chained-dot layout makes both warpgroups of an 8-warp program compute the whole 64×64 score
tile (1.52× the useful MACs; plans/0007 "Session 7"). Here the layouts are explicit. Two kernels:

- ``_mla_prefix_ws_kernel`` (the default, ``WARP_SPECIALIZE``): warp-specialised in the manner of
  FlashAttention-3 / FlashMLA's producer-consumer split. A softmax warpgroup computes each score tile
  S = q_lat·K_latᵀ + q_rope·K_ropeᵀ [64 rows, 64 keys] once, at the full 64-wide MMA, then the
  online-softmax update, its row sum and acc·alpha + P·V over V columns 0…255; a second warpgroup
  does P·V over columns 256…511 with the P and alpha left in shared memory; one warp streams the key
  blocks by TMA into a two-stage ring (mbarriers: block landed, stage free, P ready, P free).
- ``_mla_prefix_kernel`` (one 8-warp program): S with warps [4, 2] (each warpgroup its 32 key
  columns), the row max across warpgroups, P to shared memory, acc [64, 512] with warps [4, 2].

Both give the Triton launch's partials bit for bit (tested on the H200: ``tests/kernels/
test_mla_prefix.py``), so the Triton tree-block launch continues them and a tree node still equals
its one-row decode after commit (row invariance). That holds because every operation of the fold is
elementwise, an exact max, or a tensor-core MMA whose elements do not depend on the instruction
tiling — the row sum included: it is an MMA, P·1, here and in ``_step``.

Restrictions (``unsupported`` names the first that fails): bf16, h·block_r = 64, latent C = 512, rope R = 64, BN = 64, vsplit 1,
a CUDA device of compute capability 9.x; elsewhere ``mla_attention`` uses the Triton launch.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

WARP_SPECIALIZE = True  # prefix_partials' default kernel (session 12: see plans/0007)
ONES_N = gl.constexpr(16)  # columns of the all-ones B operand of the row-sum MMA (one 8-column slice per warpgroup)


@gluon.jit
def _probs(q_smem, q_rope, kl, kr, m, pos_m, start, nb, qk_scale, s_l: gl.constexpr, BM: gl.constexpr,
           BN: gl.constexpr):
    """One block's scores S = q_lat·K_latᵀ + q_rope·K_ropeᵀ [BM, BN] and ``_step``'s softmax part,
    operation for operation: (m_new, alpha, P in bf16)."""
    s = warpgroup_mma(q_smem, kl.permute((1, 0)), gl.zeros([BM, BN], gl.float32, s_l), use_acc=False)
    s = warpgroup_mma(q_rope, kr.permute((1, 0)), s)
    valid = (start + nb)[None, :] <= pos_m[:, None]
    s = gl.where(valid, s * qk_scale, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, axis=1))
    return m_new, gl.exp2(m - m_new), gl.exp2(s - m_new[:, None]).to(gl.bfloat16)


@gluon.jit
def _load(lat_desc, rope_desc, bar, lat_dst, rope_dst, row, pred):
    """TMA the key block at pool row ``row`` (latent and rope parts) into one ring stage; bar
    completes when its bytes have landed."""
    mbarrier.expect(bar, lat_desc.block_type.nbytes + rope_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(lat_desc, [row.to(gl.int32), 0], bar, lat_dst, pred=pred)
    tma.async_copy_global_to_shared(rope_desc, [row.to(gl.int32), 0], bar, rope_dst, pred=pred)


@gluon.jit
def _row(pg_ptr, base, q, pred, PAGED: gl.constexpr, PR: gl.constexpr):
    """Pool row of a request's logical row q: ``base + q``, or with page tables (PAGED) row q % PR of
    page ``pg[base + q // PR]`` (base: the request's table offset; the table is read only where pred,
    so a predicated-off prefetch past L never reads beyond it) — as specdec_kernels.mla_attention._pool_row."""
    if PAGED:
        return gl.load(pg_ptr + base + q // PR, mask=pred, other=0).to(gl.int64) * PR + q % PR
    else:
        return base + q


@gluon.jit
def _tile(tile_ptr, BN: gl.constexpr, CHUNK: gl.constexpr):
    """This program's tile and chunk: (first row, rows, pool base, ⌊L/BN⌋·BN, chunk, chunk start)."""
    t = gl.program_id(0)
    ch = gl.program_id(1)
    L = gl.load(tile_ptr + t * 4 + 3)
    return (gl.load(tile_ptr + t * 4), gl.load(tile_ptr + t * 4 + 1), gl.load(tile_ptr + t * 4 + 2), (L // BN) * BN,
            ch, ch * CHUNK)


@gluon.jit(do_not_specialize=["NCH"])
def _mla_prefix_kernel(q_ptr, lat_desc, rope_desc, pm_ptr, pl_ptr, pacc_ptr, pos_ptr, tile_ptr, pg_ptr,
                       sq_row, sq_head, qk_scale, NCH,
                       H: gl.constexpr, BLOCK_R: gl.constexpr, C: gl.constexpr, R: gl.constexpr,
                       BN: gl.constexpr, CHUNK: gl.constexpr, PAGED: gl.constexpr, PR: gl.constexpr):
    """Program (tile, chunk): fold the chunk's blocks below ⌊L/BN⌋·BN and store (m, l, acc) as
    the chunk's partial, exactly as ``_mla_chunk_kernel`` with TAIL=False, VSPLIT=1."""
    BM: gl.constexpr = BLOCK_R * H
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, C // 2, 16])
    n_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, ONES_N // 2, 16])
    qr_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
    ld_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[8, 1],
                                          order=[1, 0])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    rows_ld: gl.constexpr = gl.SliceLayout(1, ld_l)

    r0, nr, base, L0, ch, cs = _tile(tile_ptr, BN, CHUNK)

    mm = gl.arange(0, BM, layout=rows_s)
    ok = mm // H < nr
    pos_m = gl.load(pos_ptr + r0 + mm // H, mask=ok, other=-1)
    if cs < L0:  # a chunk without prefix blocks is not written: the tree launch starts it empty
        # queries: the latent part in shared memory (A operand), the rope part in registers
        lm = gl.arange(0, BM, layout=rows_ld)
        lok = lm // H < nr
        qrow = q_ptr + (r0 + lm // H).to(gl.int64) * sq_row + (lm % H) * sq_head
        qc = gl.arange(0, C, layout=gl.SliceLayout(0, ld_l))
        q_lat = gl.load(qrow[:, None] + qc[None, :], mask=lok[:, None], other=0.0)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, C],
                                           gl.NVMMASharedLayout.get_default_for([BM, C], gl.bfloat16), q_lat)
        qd = gl.arange(0, R, layout=gl.SliceLayout(0, ld_l))
        q_rope = gl.load(qrow[:, None] + C + qd[None, :], mask=lok[:, None], other=0.0)
        q_rope = gl.convert_layout(q_rope, qr_l)
        ones = gl.full([ONES_N, BN], 1.0, gl.bfloat16, ld_l)
        ones_smem = gl.allocate_shared_memory(gl.bfloat16, [ONES_N, BN],
                                              gl.NVMMASharedLayout.get_default_for([ONES_N, BN], gl.bfloat16), ones)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN],
                                           gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16))
        lat_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, C], lat_desc.layout)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, R], rope_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(bars.index(0), count=1)
        mbarrier.init(bars.index(1), count=1)
        fence_async_shared()

        n_blk = (gl.maximum(gl.minimum(cs + CHUNK, L0) - cs, 0) // BN).to(gl.int32)
        for k in gl.static_range(2):  # prologue: blocks 0 and 1 of the chunk
            _load(lat_desc, rope_desc, bars.index(k), lat_smem.index(k), rope_smem.index(k),
                  _row(pg_ptr, base, cs + k * BN, k < n_blk, PAGED, PR), k < n_blk)

        m = gl.full([BM], -1.0e30, gl.float32, rows_s)  # finite: 2^(m - m) = 1, never NaN
        l = gl.zeros([BM], gl.float32, rows_s)
        acc = gl.zeros([BM, C], gl.float32, o_l)
        nb = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
        for j in range(n_blk):
            st = j % 2
            mbarrier.wait(bars.index(st), (j // 2) & 1)
            kl = lat_smem.index(st)
            m_new, alpha, p = _probs(q_smem, q_rope, kl, rope_smem.index(st), m, pos_m, cs + j * BN, nb, qk_scale,
                                     s_l, BM, BN)
            gl.thread_barrier()  # every warpgroup's MMAs on the previous P are done
            p_smem.store(p)
            fence_async_shared()
            gl.thread_barrier()
            rs = warpgroup_mma(p_smem, ones_smem.permute((1, 0)), gl.zeros([BM, ONES_N], gl.float32, n_l),
                               use_acc=False)
            l = l * alpha + gl.convert_layout(gl.max(rs, axis=1), rows_s)
            acc = warpgroup_mma(p_smem, kl, acc * gl.convert_layout(alpha, rows_o)[:, None])
            m = m_new
            gl.thread_barrier()  # both warpgroups are done with stage st: refill it with block j + 2
            _load(lat_desc, rope_desc, bars.index(st), kl, rope_smem.index(st),
                  _row(pg_ptr, base, cs + (j + 2) * BN, j + 2 < n_blk, PAGED, PR), j + 2 < n_blk)
        mbarrier.invalidate(bars.index(0))
        mbarrier.invalidate(bars.index(1))

        hh = mm % H
        slot = ((r0 + mm // H) * NCH + ch) * H + hh                                  # [BM] (row, chunk, head)
        gl.store(pm_ptr + slot, m, mask=ok)
        gl.store(pl_ptr + slot, l, mask=ok)
        mo = gl.arange(0, BM, layout=rows_o)
        oslot = ((r0 + mo // H) * NCH + ch) * H + mo % H
        co = gl.arange(0, C, layout=gl.SliceLayout(0, o_l))
        gl.store(pacc_ptr + oslot.to(gl.int64)[:, None] * C + co[None, :], acc, mask=(mo // H < nr)[:, None])


@gluon.jit
def _ws_softmax(q_smem, qr_smem, ones_smem, p_smem, a_smem, lat_smem, rope_smem, bars, pm_ptr, pl_ptr, pacc_ptr,
                pos_ptr, r0, nr, ch, cs, n_blk, NCH, qk_scale, store,
                H: gl.constexpr, BM: gl.constexpr, C: gl.constexpr, BN: gl.constexpr):
    """Default partition (one warpgroup): block j's scores (once, 64×64 MMAs: operands balanced
    with shared memory), the softmax, P and alpha to shared memory for the P·V warpgroup, then
    its own row sum and acc·alpha + P·V over V columns 0…C/2. Stores m, l and its acc half."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, C // 2, 16])
    n_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ONES_N, 16])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_l)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    kready, kfree, pready, pfree = bars.index(0), bars.index(2), bars.index(4), bars.index(5)
    mm = gl.arange(0, BM, layout=rows_s)
    ok = mm // H < nr
    pos_m = gl.load(pos_ptr + r0 + mm // H, mask=ok, other=-1)
    nb = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
    m = gl.full([BM], -1.0e30, gl.float32, rows_s)  # finite: 2^(m - m) = 1, never NaN
    l = gl.zeros([BM], gl.float32, rows_s)
    acc = gl.zeros([BM, C // 2], gl.float32, o_l)
    for j in range(n_blk):
        st = j % 2
        mbarrier.wait(bars.index(st), (j // 2) & 1)                                    # block j landed
        kl = lat_smem.index(st)
        m_new, alpha, p = _probs(q_smem, qr_smem, kl, rope_smem.index(st), m, pos_m, cs + j * BN, nb, qk_scale, s_l,
                                 BM, BN)
        mbarrier.wait(pfree, (j & 1) ^ 1)                     # the other warpgroup is done with P and alpha of j - 1
        p_smem.store(p)
        a_smem.store(alpha)
        fence_async_shared()
        mbarrier.arrive(pready, count=1)
        rs = warpgroup_mma(p_smem, ones_smem.permute((1, 0)), gl.zeros([BM, ONES_N], gl.float32, n_l),
                           use_acc=False)
        l = l * alpha + gl.convert_layout(gl.max(rs, axis=1), rows_s)
        acc = warpgroup_mma(p_smem, kl.slice(0, C // 2, dim=1), acc * gl.convert_layout(alpha, rows_o)[:, None])
        m = m_new
        mbarrier.arrive(bars.index(2 + st), count=1)          # this warpgroup is done with stage st
    slot = ((r0 + mm // H) * NCH + ch) * H + mm % H
    gl.store(pm_ptr + slot, m, mask=ok & store)
    gl.store(pl_ptr + slot, l, mask=ok & store)
    mo = gl.arange(0, BM, layout=rows_o)
    oslot = ((r0 + mo // H) * NCH + ch) * H + mo % H
    co = gl.arange(0, C // 2, layout=gl.SliceLayout(0, o_l))
    gl.store(pacc_ptr + oslot.to(gl.int64)[:, None] * C + co[None, :], acc, mask=(mo // H < nr)[:, None] & store)


@gluon.jit
def _ws_pv(lat_desc, rope_desc, p_smem, a_smem, lat_smem, rope_smem, bars, pacc_ptr, r0, nr, ch, cs, base, n_blk,
           NCH, store, H: gl.constexpr, BM: gl.constexpr, C: gl.constexpr, BN: gl.constexpr):
    """Worker partition (one warpgroup): acc·alpha + P·V over V columns C/2…C, block by block,
    with the P and alpha the softmax warpgroup left in shared memory; stores its acc half."""
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, C // 2, 16])
    rows_o: gl.constexpr = gl.SliceLayout(1, o_l)
    acc = gl.zeros([BM, C // 2], gl.float32, o_l)
    for j in range(n_blk):
        st = j % 2
        mbarrier.wait(bars.index(st), (j // 2) & 1)
        mbarrier.wait(bars.index(4), j & 1)                   # P and alpha of block j
        alpha = a_smem.load(rows_o)
        acc = warpgroup_mma(p_smem, lat_smem.index(st).slice(C // 2, C // 2, dim=1), acc * alpha[:, None])
        mbarrier.arrive(bars.index(5), count=1)               # P and alpha may be overwritten
        mbarrier.arrive(bars.index(2 + st), count=1)          # this warpgroup is done with stage st
    mo = gl.arange(0, BM, layout=rows_o)
    oslot = ((r0 + mo // H) * NCH + ch) * H + mo % H
    co = C // 2 + gl.arange(0, C // 2, layout=gl.SliceLayout(0, o_l))
    gl.store(pacc_ptr + oslot.to(gl.int64)[:, None] * C + co[None, :], acc, mask=(mo // H < nr)[:, None] & store)


@gluon.jit
def _ws_load(lat_desc, rope_desc, p_smem, a_smem, lat_smem, rope_smem, bars, pacc_ptr, r0, nr, ch, cs, base, n_blk,
             NCH, store, pg_ptr, H: gl.constexpr, BM: gl.constexpr, C: gl.constexpr, BN: gl.constexpr,
             PAGED: gl.constexpr, PR: gl.constexpr):
    """Worker partition (one warp): TMA loads of key blocks into the two-stage ring, a stage
    refilled once both warpgroups are done with the block it held."""
    for j in range(n_blk):
        st = j % 2
        mbarrier.wait(bars.index(2 + st), ((j // 2) & 1) ^ 1)  # stage free (passes at once the first time)
        _load(lat_desc, rope_desc, bars.index(st), lat_smem.index(st), rope_smem.index(st),
              _row(pg_ptr, base, cs + j * BN, True, PAGED, PR), True)


@gluon.jit(do_not_specialize=["NCH"])
def _mla_prefix_ws_kernel(q_ptr, lat_desc, rope_desc, pm_ptr, pl_ptr, pacc_ptr, pos_ptr, tile_ptr, pg_ptr,
                          sq_row, sq_head, qk_scale, NCH,
                          H: gl.constexpr, BLOCK_R: gl.constexpr, C: gl.constexpr, R: gl.constexpr,
                          BN: gl.constexpr, CHUNK: gl.constexpr, PV_REGS: gl.constexpr, PAGED: gl.constexpr,
                          PR: gl.constexpr):
    """Warp-specialised variant of ``_mla_prefix_kernel`` (same partials, bit for bit): a
    softmax warpgroup computes each score tile once at the full 64-wide MMA, a second warpgroup
    does half of P·V beside it, one warp streams the key blocks (FlashAttention-3 / FlashMLA-style
    producer-consumer split; launched with 4 warps + the workers)."""
    BM: gl.constexpr = BLOCK_R * H
    ld_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                          order=[1, 0])
    rows_ld: gl.constexpr = gl.SliceLayout(1, ld_l)
    r0, nr, base, L0, ch, cs = _tile(tile_ptr, BN, CHUNK)
    lm = gl.arange(0, BM, layout=rows_ld)
    lok = lm // H < nr
    store = cs < L0                            # as the Triton launch: only chunks holding prefix blocks are written
    n_blk = gl.where(store, (gl.maximum(gl.minimum(cs + CHUNK, L0) - cs, 0) // BN), 0).to(gl.int32)
    qrow = q_ptr + (r0 + lm // H).to(gl.int64) * sq_row + (lm % H) * sq_head
    qc = gl.arange(0, C, layout=gl.SliceLayout(0, ld_l))
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, C], gl.NVMMASharedLayout.get_default_for([BM, C], gl.bfloat16),
                                       gl.load(qrow[:, None] + qc[None, :], mask=lok[:, None] & store, other=0.0))
    qd = gl.arange(0, R, layout=gl.SliceLayout(0, ld_l))
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, R], gl.NVMMASharedLayout.get_default_for([BM, R], gl.bfloat16),
                                        gl.load(qrow[:, None] + C + qd[None, :], mask=lok[:, None] & store, other=0.0))
    ones_smem = gl.allocate_shared_memory(gl.bfloat16, [ONES_N, BN],
                                          gl.NVMMASharedLayout.get_default_for([ONES_N, BN], gl.bfloat16),
                                          gl.full([ONES_N, BN], 1.0, gl.bfloat16, ld_l))
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16))
    a_smem = gl.allocate_shared_memory(gl.float32, [BM], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    lat_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, C], lat_desc.layout)
    rope_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, R], rope_desc.layout)
    # barriers: 0, 1 block in stage landed; 2, 3 stage free (both warpgroups); 4 P ready; 5 P free
    bars = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(6):
        mbarrier.init(bars.index(k), count=1 + (k == 2) + (k == 3))
    fence_async_shared()
    gl.warp_specialize([
        (_ws_softmax, (q_smem, qr_smem, ones_smem, p_smem, a_smem, lat_smem, rope_smem, bars, pm_ptr, pl_ptr, pacc_ptr,
                       pos_ptr, r0, nr, ch, cs, n_blk, NCH, qk_scale, store, H, BM, C, BN)),
        (_ws_pv, (lat_desc, rope_desc, p_smem, a_smem, lat_smem, rope_smem, bars, pacc_ptr, r0, nr, ch, cs, base, n_blk,
                  NCH, store, H, BM, C, BN)),
        (_ws_load, (lat_desc, rope_desc, p_smem, a_smem, lat_smem, rope_smem, bars, pacc_ptr, r0, nr, ch, cs, base,
                    n_blk, NCH, store, pg_ptr, H, BM, C, BN, PAGED, PR)),
    ], [4, 1], [PV_REGS, 24])


def unsupported(q: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int, block_r: int, bn: int,
                vsplit: int) -> str | None:
    """Why ``prefix_partials`` cannot run these inputs (the first condition that fails), or None
    when it can (see the module docstring)."""
    T, h, D = q.shape
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return f"q is on {q.device}, not a compute-capability-9 GPU"
    if kv.device != q.device:
        return f"kv is on {kv.device}, q on {q.device}"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"q and kv must be bf16, got {q.dtype} and {kv.dtype}"
    if kv_lora_rank != 512 or D - kv_lora_rank != 64:
        return f"latent C must be 512 and rope R 64, got C={kv_lora_rank}, R={D - kv_lora_rank}"
    if block_r * h != 64 or bn != 64 or vsplit != 1:
        return f"needs h·block_r 64, bn 64, vsplit 1; got h={h}, block_r={block_r}, bn={bn}, vsplit={vsplit}"
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        return f"q and kv need unit stride in their last dimension, got {q.stride(-1)} and {kv.stride(-1)}"
    if kv.data_ptr() % 16 or kv.stride(0) * 2 % 16:
        return f"kv rows must start at 16-byte aligned addresses (TMA), row stride {kv.stride(0)} elements"
    return None


def prefix_partials(q, kv, pm, pl, pacc, positions, tiles, scale_log2: float, nch: int, h: int, block_r: int,
                    chunk: int, kv_lora_rank: int, warp_specialize: bool | None = None,
                    pages: torch.Tensor | None = None, page_rows: int = 128) -> None:
    """Fill pm, pl [T, nch, 1, h] and pacc [T, nch, h, C] (fp32) for every (tile, chunk) whose
    chunk holds prefix blocks (starts below the tile's ⌊L/BN⌋·BN), as ``_mla_chunk_kernel`` (TAIL=False)
    does. q [T, h, C + R] bf16, kv [rows, C + R] bf16 (the latent pool of one layer), positions
    [T] int64, tiles the ``make_tiles`` table, scale_log2 = softmax scale · log2(e).
    warp_specialize: ``_mla_prefix_ws_kernel`` (True) or ``_mla_prefix_kernel``; None: the
    module's WARP_SPECIALIZE. Both give the same bits. pages: a paged pool's page tables (tiles' base
    then a request's table offset; ``specdec_kernels.mla_attention.mla_attention``'s layout), page_rows a
    multiple of 64 (a key block never straddles a page: one TMA load per block, as contiguous)."""
    C = kv_lora_rank
    R = kv.shape[-1] - C
    bn = 64
    lat = TensorDescriptor(kv, [kv.shape[0], C], [kv.stride(0), 1], [bn, C],
                           gl.NVMMASharedLayout.get_default_for([bn, C], gl.bfloat16))
    rope = TensorDescriptor(kv[:, C:], [kv.shape[0], R], [kv.stride(0), 1], [bn, R],
                            gl.NVMMASharedLayout.get_default_for([bn, R], gl.bfloat16))
    args = (q, lat, rope, pm, pl, pacc, positions, tiles, tiles if pages is None else pages, q.stride(0), q.stride(1),
            scale_log2, nch)
    meta = dict(H=h, BLOCK_R=block_r, C=C, R=R, BN=bn, CHUNK=chunk, PAGED=pages is not None, PR=page_rows)
    if WARP_SPECIALIZE if warp_specialize is None else warp_specialize:
        _mla_prefix_ws_kernel[(tiles.shape[0], nch)](*args, **meta, PV_REGS=232, num_warps=4)
    else:
        _mla_prefix_kernel[(tiles.shape[0], nch)](*args, **meta, num_warps=8)
