"""DDTree build in one launch: per-depth top-K log-probs → the best-first draft tree
(DDTree, "Drafting via dynamic trees"; shared DOMAIN notes §3).

One program per request runs the literal best-first search of the reference
(``draft_service.ddtree.build_ddtree_reference``): a max-heap of (cumulative log-prob,
push order) seeded with (depth 1, rank 0); each pop becomes node n (n = 1, 2, … in pop order)
and pushes its next sibling (same parent, rank + 1, if rank + 1 < K), then its first child
(depth + 1, rank 0, if depth < D); it stops at ``budget`` nodes or an empty heap.

The heap never holds more than one entry per tree node (node p's entry is its next unpopped
child), so it is a register vector with one slot per node. A slot's key packs, in one int64,
the order-preserving bits of the candidate's float32 score, the push order (ties pop in push
order: a push made at pop n has order 2n for a sibling and 2n + 1 for a child, the seed 1)
and the slot, so one ``max`` reduction pops; a second (masked sum) reads the parent's depth,
rank and score. Scores are float32 sums ``score[parent] + lp[depth-1, rank]`` in the same order
as the reference, so trees — node order, tokens, parents, depths, scores, tie-breaking — are
identical given the same ranked top-K lists.

A tree built from top-K lists with K ≥ budget and truncated to its first ``budget`` nodes is the
budget's tree (rank ≥ budget entries are pushed only after ``budget`` pops), so one capture at a
bucket's K serves every budget up to it; the budget is read from device memory for that reason.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BUDGET = 1023  # slots fit 10 bits of the key; the push order 11 bits


@triton.jit
def _encode(score, order, slot):
    """int64 key, larger = pops first: score (−0.0 as +0.0), then smaller push order."""
    s = tl.where(score == 0.0, 0.0, score)
    b = s.to(tl.int32, bitcast=True).to(tl.int64)  # sign-extended bits
    ordered = tl.where(b >= 0, b + 2147483647 + 1, -1 - b)  # in [0, 2^32), monotone in s
    return (ordered << 21) | ((2047 - order) << 10) | slot


@triton.jit
def _ddtree_kernel(lp_ptr, ids_ptr, root_ptr, budget_ptr, nodes_ptr, sc_ptr, cnt_ptr,
                   D, K, s_in, CAP, F: tl.constexpr):
    r = tl.program_id(0)
    s_out = CAP + 1
    tok_ptr = nodes_ptr + r * 3 * s_out  # nodes [R, 3, CAP+1]: tokens, parents, depths
    par_ptr = tok_ptr + s_out
    dep_ptr = par_ptr + s_out
    lp_row = lp_ptr + r * s_in
    ids_row = ids_ptr + r * s_in
    budget = tl.minimum(tl.load(budget_ptr), CAP)
    idx = tl.arange(0, F)
    # slot 0 = the root: its first child (depth 1, rank 0), push order 1
    key = tl.where(idx == 0, _encode(tl.load(lp_row) + 0.0, 1, 0), -1)
    # per slot: (depth << 42) | (next child rank << 32) | float32 bits of the node's score
    info = tl.zeros((F,), tl.int64)
    tl.store(tok_ptr, tl.load(root_ptr + r))
    tl.store(par_ptr, -1)
    tl.store(dep_ptr, 0)
    tl.store(sc_ptr + r * s_out, 0.0)
    count = budget * 0
    for n in range(1, budget + 1):
        m = tl.max(key, 0)
        ok = m >= 0
        p = tl.where(ok, m & 1023, -1)
        pinfo = tl.sum(tl.where(idx == p, info, 0), 0)
        d = (pinfo >> 42) + 1  # the new node's depth
        rank = (pinfo >> 32) & 1023
        pscore = pinfo.to(tl.int32).to(tl.float32, bitcast=True)  # low 32 bits
        off = (d - 1) * K + rank
        score = pscore + tl.load(lp_row + off, mask=ok, other=0.0)
        sib = ok & (rank + 1 < K)
        child = ok & (d < D)
        s_sib = pscore + tl.load(lp_row + off + 1, mask=sib, other=0.0)
        s_child = score + tl.load(lp_row + d * K, mask=child, other=0.0)
        key = tl.where(idx == p, tl.where(sib, _encode(s_sib, 2 * n, p), -1), key)
        key = tl.where((idx == n) & child, _encode(s_child, 2 * n + 1, n), key)
        info = tl.where(idx == p, pinfo + (1 << 32), info)
        new = (d << 42) | score.to(tl.uint32, bitcast=True).to(tl.int64)
        info = tl.where((idx == n) & ok, new, info)
        tl.store(tok_ptr + n, tl.where(ok, tl.load(ids_row + off, mask=ok, other=-1), -1))
        tl.store(par_ptr + n, tl.where(ok, p, -1).to(tl.int64))
        tl.store(dep_ptr + n, tl.where(ok, d, 0))
        tl.store(sc_ptr + r * s_out + n, tl.where(ok, score, 0.0))
        count += ok.to(tl.int32)
    tl.store(cnt_ptr + r, count.to(tl.int32))


def num_warps_for(slots: int) -> int:
    """Warps per program: one warp up to 256 slots (register shuffles only), more above."""
    return 1 if slots <= 256 else 2 if slots <= 512 else 4


def build_ddtree_topk(top_lp: torch.Tensor, top_ids: torch.Tensor, root: torch.Tensor,
                      budget: torch.Tensor | int, capacity: int | None = None, num_warps: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best-first DDTree per request from ranked top-K lists, one launch (graph-capturable:
    no host sync, outputs allocated here).

    top_lp:  [R, D, K] float32, per-depth log-probs sorted descending along K (as
             ``torch.topk`` of ``draft_service.ddtree._log_probs`` returns them).
    top_ids: [R, D, K] int64 token ids of those entries.
    root:    [R] int64 root (bonus) tokens.
    budget:  int, or a 1-element int64 device tensor read inside the kernel (so a CUDA graph
             captured at one capacity serves every budget up to it; clamped to capacity).
    capacity: node slots per tree (default: budget, which must then be an int), ≤ MAX_BUDGET.
    num_warps: per program (default ``num_warps_for``; sweeps only).
    Returns (nodes, scores, count) on top_lp.device:
      nodes  [R, 3, capacity+1] int64: tokens, parents, depths; index 0 = root (parent -1,
             depth 0), nodes 1…count in best-first (pop) order, parents precede children;
             entries count+1…budget hold token -1, parent -1, depth 0; entries after budget
             are left unwritten.
      scores [R, capacity+1] float32 cumulative draft log-prob (root 0.0).
      count  [R] int32: non-root nodes, min(budget, Σ_{d=1..D} K^d).
    Raises ValueError for bad shapes, dtypes or sizes.
    """
    if top_lp.dim() != 3 or top_lp.shape != top_ids.shape or top_lp.dtype != torch.float32 \
            or top_ids.dtype != torch.int64 or min(top_lp.shape) < 1:
        raise ValueError("top_lp / top_ids must be non-empty [R, D, K] float32 / int64 of one shape")
    R, D, K = top_lp.shape
    dev = top_lp.device
    if isinstance(budget, int):
        capacity = budget if capacity is None else capacity
        budget = torch.full((1,), budget, dtype=torch.int64, device=dev)
    if capacity is None or not 1 <= capacity <= MAX_BUDGET or D > 63:
        raise ValueError(f"capacity must be in [1, {MAX_BUDGET}] and D <= 63, got {capacity}, D={D}")
    top_lp, top_ids = top_lp.contiguous(), top_ids.contiguous()
    nodes = torch.empty(R, 3, capacity + 1, dtype=torch.int64, device=dev)
    scores = torch.empty(R, capacity + 1, dtype=torch.float32, device=dev)
    count = torch.empty(R, dtype=torch.int32, device=dev)
    F = triton.next_power_of_2(capacity + 1)
    _ddtree_kernel[(R,)](top_lp, top_ids, root, budget, nodes, scores, count, D, K, D * K, capacity,
                         F=F, num_warps=num_warps or num_warps_for(F))
    return nodes, scores, count
