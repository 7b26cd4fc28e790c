"""Top-K log-probs per row in two launches: the drafter's ranked lists for the DDTree build
(``specdec_kernels.ddtree_build``) without ``torch.log_softmax`` + ``torch.topk`` (~15 small kernels
inside the propose graph: a softmax, a clamp and the radix select's digit passes).

Launch 1, grid (rows, chunks of C logits): the chunk's max m and Σ exp(x − m) (for the row's
log-sum-exp), and its top-KP (KP = the next power of two ≥ max(K, 2)) by a bitonic ``tl.topk`` over int64
keys packing the order-preserving bits of the float32 logit and the inverted token id (equal
logits rank by smaller id, as a stable descending argsort does). Launch 2, one program per
row: lse = M + log Σ_c s_c · exp(m_c − M) over the chunks, then the top-K of the chunks'
candidates (the row's top-K is among them: each chunk kept its own top-KP ≥ K) and
lp = min(x − lse, 0) in float32.

Ranking is by logit, so a row's order equals the order of its log-probs (x − lse is monotone
in x); lp values differ from ``torch.log_softmax`` by float32 rounding of lse only (a few
ulps). The drafter only steers proposals, so this changes no emitted token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_K = 64  # above this the merge sorts too many candidates in one program: use torch.topk
CHUNK = 2048
ID_BITS = 31  # token ids < 2^31


@triton.jit
def _key(x, ids):
    """int64 key, larger = ranks first: the float32 logit (−0.0 as +0.0), then the smaller id."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(b >= 0, b + 2147483648, -1 - b)  # [0, 2^32), monotone in x
    return (ordered << 31) | (2147483647 - ids)


@triton.jit
def _chunk_kernel(x_ptr, key_ptr, m_ptr, s_ptr, V, s_x, NCH, C: tl.constexpr, KP: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    ids = c * C + tl.arange(0, C)
    ok = ids < V
    x = tl.load(x_ptr + r * s_x + ids, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.where(ok, tl.exp(x - m), 0.0), 0)
    tl.store(m_ptr + r * NCH + c, m)
    tl.store(s_ptr + r * NCH + c, s)
    key = tl.where(ok, _key(x, ids.to(tl.int64)), -1)
    top = tl.topk(key, KP)  # [KP] descending
    tl.store(key_ptr + (r * NCH + c) * KP + tl.arange(0, KP), top)


@triton.jit
def _merge_kernel(key_ptr, m_ptr, s_ptr, lp_ptr, ids_ptr, K, NCH, NCP: tl.constexpr, NKP: tl.constexpr,
                  KP: tl.constexpr):
    r = tl.program_id(0)
    cs = tl.arange(0, NCP)
    m = tl.load(m_ptr + r * NCH + cs, mask=cs < NCH, other=float("-inf"))
    s = tl.load(s_ptr + r * NCH + cs, mask=cs < NCH, other=0.0)
    big = tl.max(m, 0)
    lse = big + tl.log(tl.sum(tl.where(cs < NCH, s * tl.exp(m - big), 0.0), 0))
    j = tl.arange(0, NKP)
    key = tl.load(key_ptr + r * NCH * KP + j, mask=j < NCH * KP, other=-1)
    top = tl.topk(key, KP)  # [KP] descending
    ordered = top >> 31
    b = tl.where(ordered >= 2147483648, ordered - 2147483648, -1 - ordered)
    x = b.to(tl.int32).to(tl.float32, bitcast=True)
    tok = 2147483647 - (top & 2147483647)
    k = tl.arange(0, KP)
    tl.store(lp_ptr + r * K + k, tl.minimum(x - lse, 0.0), mask=k < K)
    tl.store(ids_ptr + r * K + k, tok, mask=k < K)


def topk_log_probs(logits: torch.Tensor, k: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row the top-k float32 log-probs (log_softmax over V, clamped to ≤ 0) and their ids,
    sorted descending, equal logits by smaller id. Two launches, graph-capturable (outputs and
    scratch allocated here, no host sync).

    logits: [..., V] float (read as float32), V < 2^31; k in [1, min(MAX_K, V)];
    chunk: logits per program of the first launch (power of two ≥ k; tests shrink it).
    Returns (lp [..., k] float32, ids [..., k] int64) on logits.device.
    Raises ValueError for k out of range or a bad chunk.
    """
    V = logits.shape[-1]
    if not 1 <= k <= min(MAX_K, V):
        raise ValueError(f"k must be in [1, {min(MAX_K, V)}], got {k}")
    KP = max(2, triton.next_power_of_2(k))  # tl.topk needs ≥ 2 to keep a vector
    if chunk & (chunk - 1) or chunk < KP:
        raise ValueError(f"chunk must be a power of two >= {KP}, got {chunk}")
    lead = logits.shape[:-1]
    x = logits.reshape(-1, V)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R, C = x.shape[0], min(chunk, max(triton.next_power_of_2(V), KP))
    nch = triton.cdiv(V, C)
    dev = x.device
    keys = torch.empty(R, nch, KP, dtype=torch.int64, device=dev)
    m = torch.empty(R, nch, dtype=torch.float32, device=dev)
    s = torch.empty(R, nch, dtype=torch.float32, device=dev)
    lp = torch.empty(R, k, dtype=torch.float32, device=dev)
    ids = torch.empty(R, k, dtype=torch.int64, device=dev)
    _chunk_kernel[(R, nch)](x, keys, m, s, V, x.stride(0), nch, C=C, KP=KP, num_warps=4)
    _merge_kernel[(R,)](keys, m, s, lp, ids, k, nch, NCP=triton.next_power_of_2(nch),
                        NKP=triton.next_power_of_2(nch * KP), KP=KP, num_warps=4)
    return lp.view(*lead, k), ids.view(*lead, k)


def topk_log_probs_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log_softmax, ranked by (logit descending, id ascending): [..., k] float64, int64."""
    x = logits.double()
    order = torch.from_numpy((-x.cpu().numpy()).argsort(-1, kind="stable")[..., :k].copy()).to(logits.device)
    lp = torch.log_softmax(x, -1).clamp_max(0.0)
    return lp.gather(-1, order), order
