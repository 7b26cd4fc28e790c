"""The one sampling path: logits → processed distribution → token, shared by autoregressive
decoding and tree verification (every tree node is sampled exactly as plain decoding would
sample at that prefix).

Randomness is counter-based: the uniform for the token at absolute position ``pos`` of a
request is a hash of (seed, pos), so it is independent across depths, independent of the tree
shape and of the batch, and seeded speculative output equals seeded plain sampling.
Sampling is inverse-CDF over the processed distribution in token-id order (float64).
"""
from __future__ import annotations

import math

import torch

from protocol.types import SamplingParams  # noqa: F401  (the one definition; re-exported)

_M32 = 0xFFFFFFFF


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [N, V] float64 of the distribution actually sampled from: temperature,
    then top-k, then top-p (nucleus: the smallest most-probable set with mass >= top_p).
    Removed tokens get -inf. Greedy params give a one-hot (argmax, lowest id on ties)."""
    logits = logits.double()
    if params.greedy:
        out = torch.full_like(logits, -math.inf)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)
    # Shift by the row max before dividing: a tiny temperature then sends the other tokens to
    # -inf instead of overflowing to +inf (which would make log_softmax NaN).
    x = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if params.top_k > 0:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    x = x.log_softmax(-1)
    if params.top_p < 1.0:
        sorted_lp, order = x.sort(dim=-1, descending=True, stable=True)  # ties: lowest id first
        probs = sorted_lp.exp()
        before = probs.cumsum(-1) - probs  # mass strictly before each token in sorted order
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        x = x.masked_fill(drop, -math.inf).log_softmax(-1)
    return x


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return ((lo * c) + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, 'lowbias32' constants)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def position_uniforms(seed: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) float64 keyed by (seed, absolute position). positions: int64 tensor;
    seed: an int in [0, 2^64), or an int64 tensor of seeds (two's complement) that broadcasts
    with positions, e.g. one seed per run of a batch."""
    pos = positions.to(torch.int64) & _M32
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor(seed - 2 ** 64 if seed >= 2 ** 63 else seed, dtype=torch.int64)
    seed = seed.to(pos.device)
    s_lo, s_hi = seed & _M32, (seed >> 32) & _M32
    k = _mix32(pos ^ _mix32(s_lo))
    k = _mix32(k ^ _mix32(s_hi ^ 0x9E3779B9))
    h1 = _mix32(k ^ 0x85EBCA6B)
    h2 = _mix32(h1 ^ 0xC2B2AE35)
    bits = (h1 >> 5) * (1 << 27) + (h2 >> 5)  # 27 + 27 = 54 bits → use 53
    return ((bits >> 1).double() + 0.5) / float(1 << 53)


def inverse_cdf(logprobs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw in token-id order, float64. logprobs [..., V] (a -inf entry is never
    drawn); u [..., K] uniforms in (0, 1), K draws per row. Returns [..., K] int64: for each u
    the smallest token id whose cumulative probability reaches u times the row's total."""
    cdf = logprobs.double().exp().cumsum(-1)
    idx = torch.searchsorted(cdf, u.double() * cdf[..., -1:])
    return idx.clamp_(max=cdf.shape[-1] - 1)


def sample(logits: torch.Tensor, params: SamplingParams, positions: torch.Tensor,
           logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row. logits [N, V]; positions [N] int64 (absolute position of the
    token being drawn). Returns [N] int64 on logits.device. Greedy = argmax, no noise."""
    if params.greedy:
        return logits.argmax(-1)
    lp = processed_logprobs(logits, params) if logprobs is None else logprobs
    u = position_uniforms(params.seed, positions).to(lp.device)
    return inverse_cdf(lp, u[:, None])[:, 0]


# -- the same law with the parameters on the device (CUDA-graph capturable) ----------------------

def filtered(params: SamplingParams) -> bool:
    """Whether top-k or top-p removes tokens (the device sampler then needs its sorts)."""
    return params.top_k > 0 or params.top_p < 1.0


def sampling_words(params: SamplingParams) -> list[int]:
    """Non-greedy params as 4 int64 words for a device buffer: (temperature as float64 bits,
    top_k, top_p as float64 bits, seed as two's complement) — see ``sample_tree_device``."""
    bits = lambda f: int(torch.tensor(float(f), dtype=torch.float64).view(torch.int64))
    seed = params.seed - 2 ** 64 if params.seed >= 2 ** 63 else params.seed
    return [bits(params.temperature), params.top_k, bits(params.top_p), seed]


def processed_logprobs_device(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                              top_p: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """``processed_logprobs`` for non-greedy params given as 0-d device tensors (temperature,
    top_p float64; top_k int64, 0 = off) with no host branch, so a CUDA graph can hold it:
    top-k's k-th value is read from a descending sort at index k−1, and top-p's renormalisation
    is computed always and selected with ``where``. Same law; the rounding of the temperature
    division may differ from the host-scalar version in the last bit, so one engine uses one of
    the two for every row it samples (AR and speculative rounds alike). ``filtered=False``
    skips the two sorts: bitwise the same result when top_k = 0 and top_p = 1."""
    logits = logits.double()
    x = (logits - logits.amax(-1, keepdim=True)) / temperature
    if not filtered:
        return x.log_softmax(-1)
    k = (top_k - 1).clamp(min=0, max=x.shape[-1] - 1).expand(x.shape[0], 1)
    kth = x.sort(dim=-1, descending=True).values.gather(-1, k)
    x = torch.where(top_k > 0, x.masked_fill(x < kth, -math.inf), x).log_softmax(-1)
    sorted_lp, order = x.sort(dim=-1, descending=True, stable=True)  # ties: lowest id first
    probs = sorted_lp.exp()
    drop = torch.zeros_like(order, dtype=torch.bool).scatter_(-1, order, probs.cumsum(-1) - probs >= top_p)
    return torch.where(top_p < 1.0, x.masked_fill(drop, -math.inf).log_softmax(-1), x)


def sample_tree_device(logits: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                       ancestors: torch.Tensor, meta: torch.Tensor, words: torch.Tensor,
                       filtered: bool = True) -> torch.Tensor:
    """Sample every node of a verified tree and the probability of each node's own token under
    its parent's processed distribution, on the device with no host read (DOMAIN §4: each node
    is drawn exactly as plain decoding would at its position). logits [R, V]; tokens,
    positions [R] int64 (position = L + depth); ancestors flat int64 with row stride meta[2]
    (``modeling.graphs.TreeInputs``); meta = (base, L, W); words [4] int64 from
    ``sampling_words``; filtered: False only when top_k = 0 and top_p = 1 (see
    ``processed_logprobs_device``). Returns [2, R] float64: (sampled token ids, edge
    probabilities; the root's edge is meaningless)."""
    f64 = words.view(torch.float64)
    lp = processed_logprobs_device(logits, f64[0], words[1], f64[2], filtered)
    R, V = lp.shape
    parent_slot = torch.arange(R, device=lp.device) * meta[2] + (positions - meta[1] - 1).clamp(min=0)
    parents = ancestors[parent_slot]
    edge = lp.view(-1)[parents * V + tokens].exp()
    u = position_uniforms(words[3], positions + 1)
    return torch.stack([inverse_cdf(lp, u[:, None])[:, 0].double(), edge])
