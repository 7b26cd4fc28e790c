"""The DFlash training recipe (arXiv 2602.06036 §4 as implemented by SpecForge; DOMAIN §2).

Per sequence: anchors a sampled inside the response; each makes a block [token[a], MASK×(B−1)]
at positions a…a+B−1 whose slot j is trained to predict token[a+j] (same position). Every block
sees the context features at positions < a and its own B rows (bidirectional) — exactly what
``DraftEngine.draft`` shows the drafter at inference for a block at p = a. All blocks of a
sequence go through one forward. Loss: cross-entropy on slots 1…B−1 weighted exp(−(j−1)/γ).

Shapes: b = sequences, L = padded length, A = anchors per sequence (padded), B = block size,
N = A·B query rows, H = hidden, h/g = q/kv heads, d = head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from modeling.dflash import DFlashDrafter
from modeling.layers import apply_rope

IGNORE = -100


def default_gamma(block_size: int) -> float:
    """Decay constant γ of the loss weights: 7 for B=16, 5 for B=10, 4 for B=8 (DFlash)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, block_size / 2.0 - 1.0)


def loss_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[B] float32: 0 for slot 0 (the bonus token), exp(−(j−1)/γ) for slots j = 1…B−1."""
    g = default_gamma(block_size) if gamma is None else gamma
    j = torch.arange(block_size, dtype=torch.float32)
    return torch.where(j == 0, torch.zeros(()), torch.exp(-(j - 1) / g))


def sample_anchors(prompt_len: int, length: int, max_anchors: int, generator: torch.Generator | None = None,
                   early: tuple[int, float] | None = None) -> torch.Tensor:
    """Up to ``max_anchors`` distinct anchor positions [A] int64 (ascending), drawn uniformly
    from the response positions a ∈ [prompt_len, length−2] (each has at least one label).

    ``early`` = (W, share): the first W response positions get round(share · max_anchors) of the
    anchors and the rest of the response the others (a response too short for its part gives its
    unused anchors to the other part, so the count is the uniform draw's), weighting training
    toward the start of answers — the regime of short answers and of the acceptance bench's
    first 64 tokens (plans/0008, session 11). None or share 0: the uniform draw, bit for bit."""
    lo, hi = max(prompt_len, 1), length - 1
    if hi <= lo:
        return torch.zeros(0, dtype=torch.int64)
    if early is None or early[1] <= 0:
        perm = torch.randperm(hi - lo, generator=generator)[:max_anchors]
        return (perm + lo).sort().values
    w, share = early
    if w < 0 or share > 1:
        raise ValueError(f"early anchors {tuple(early)}: W >= 0 and share <= 1 (else more than max_anchors)")
    head = min(int(w), hi - lo)
    n_tail = min(hi - lo - head, max_anchors - min(head, round(share * max_anchors)))
    n_head = min(head, max_anchors - n_tail)
    a = torch.randperm(head, generator=generator)[:n_head]
    b = torch.randperm(hi - lo - head, generator=generator)[:n_tail] + head
    return (torch.cat([a, b]) + lo).sort().values


@dataclass
class Blocks:
    """A padded batch of blocks. tokens/positions/labels: [b, A, B] int64 (labels IGNORE where
    the slot is 0, past the sequence end, or the anchor is padding); anchors [b, A] int64;
    anchor_valid [b, A] bool."""

    tokens: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    anchors: torch.Tensor
    anchor_valid: torch.Tensor

    def to(self, device) -> "Blocks":
        return Blocks(*(t.to(device) for t in (self.tokens, self.positions, self.labels, self.anchors,
                                               self.anchor_valid)))


def make_blocks(seq_tokens: torch.Tensor, lengths: torch.Tensor, anchors: list[torch.Tensor],
                block_size: int, mask_token_id: int) -> Blocks:
    """Blocks for right-padded sequences seq_tokens [b, L] with lengths [b] and per-sequence
    anchors (each [A_i] int64)."""
    b = seq_tokens.shape[0]
    A = max(1, max(len(a) for a in anchors))
    anc = torch.zeros(b, A, dtype=torch.int64)
    valid = torch.zeros(b, A, dtype=torch.bool)
    for i, a in enumerate(anchors):
        anc[i, :len(a)] = a
        valid[i, :len(a)] = True
    j = torch.arange(block_size)
    pos = anc[..., None] + j  # [b, A, B]
    inside = (pos < lengths[:, None, None]) & valid[..., None]
    gathered = seq_tokens.gather(1, pos.clamp(max=seq_tokens.shape[1] - 1).view(b, -1)).view(b, A, block_size)
    labels = torch.where(inside & (j > 0), gathered, torch.full_like(gathered, IGNORE))
    tokens = torch.full_like(gathered, mask_token_id)
    tokens[..., 0] = gathered[..., 0]
    return Blocks(tokens, pos, labels, anc, valid)


def block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Dense reference mask [A·B, S + A·B] bool (True = visible) for one sequence's blocks
    (anchors [A]) against S = context_len context rows at positions 0…S−1 followed by the
    block rows: row (i, j) sees context positions < anchors[i] and the B rows of block i."""
    A = anchors.shape[0]
    ctx = torch.arange(context_len)[None, :] < anchors[:, None]  # [A, S]
    ctx = ctx.repeat_interleave(block_size, 0)
    blk = torch.block_diag(*[torch.ones(block_size, block_size, dtype=torch.bool)] * A) if A else \
        torch.zeros(0, 0, dtype=torch.bool)
    return torch.cat([ctx, blk], 1)


def _expand(x: torch.Tensor, reps: int) -> torch.Tensor:
    """KV heads → query heads along dim −2 (query head i uses KV head i // reps, as SDPA's GQA)."""
    return x.repeat_interleave(reps, dim=-2) if reps > 1 else x


def blocks_forward(drafter: DFlashDrafter, embed: torch.Tensor, features: torch.Tensor,
                   blocks: Blocks) -> torch.Tensor:
    """All blocks of every sequence in one forward → final-normed hidden [b, A, B, H].

    features [b, L, taps·H] (context at positions 0…L−1). Same maths as ``DFlashDrafter.forward``
    with ``block_mask``: per layer, scores against the context [N, L] (visible iff position <
    anchor) and against the block's own rows [B, B] share one softmax, so no N×N work is done.
    """
    c = drafter.config
    b, L, _ = features.shape
    A, B = blocks.tokens.shape[1:]
    N, reps = A * B, c.num_attention_heads // c.num_key_value_heads
    ctx = drafter.hidden_norm(drafter.fc(features.to(drafter.fc.weight.dtype)))  # [b, L, H]
    cos_c, sin_c = drafter.rope(torch.arange(L, device=features.device), ctx.dtype)
    cos_c, sin_c = cos_c.repeat(b, 1), sin_c.repeat(b, 1)
    x = embed[blocks.tokens].reshape(b, N, -1).to(ctx.dtype)
    cos_q, sin_q = drafter.rope(blocks.positions.reshape(-1), ctx.dtype)
    visible = (torch.arange(L, device=features.device)[None, None, :]
               < blocks.anchors.repeat_interleave(B, 1)[..., None])  # [b, N, L]
    scale = 1.0 / math.sqrt(c.head_dim)
    for layer in drafter.layers:
        a = layer.self_attn
        hn = layer.input_layernorm(x)
        q = apply_rope(a.q_norm(a.q_proj(hn).view(b * N, a.h, a.d)), cos_q, sin_q).view(b, A, B, a.h, a.d)
        kc, vc = a.kv(ctx.reshape(b * L, -1), cos_c, sin_c)
        kb, vb = a.kv(hn.reshape(b * N, -1), cos_q, sin_q)
        kc, vc = _expand(kc.view(b, L, a.g, a.d), reps), _expand(vc.view(b, L, a.g, a.d), reps)
        kb, vb = _expand(kb.view(b, A, B, a.g, a.d), reps), _expand(vb.view(b, A, B, a.g, a.d), reps)
        s_ctx = torch.einsum("bajhd,blhd->bhajl", q, kc).float() * scale
        s_ctx = s_ctx.masked_fill(~visible.view(b, 1, A, B, L), float("-inf"))
        s_blk = torch.einsum("bajhd,bakhd->bhajk", q, kb).float() * scale
        p = torch.softmax(torch.cat([s_ctx, s_blk], -1), -1).to(q.dtype)
        out = (torch.einsum("bhajl,blhd->bajhd", p[..., :L], vc)
               + torch.einsum("bhajk,bakhd->bajhd", p[..., L:], vb))
        x = x + a.o_proj(out.reshape(b, N, a.h * a.d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(b, A, B, -1)


def select_rows(hidden: torch.Tensor, blocks: Blocks, weights: torch.Tensor):
    """Rows that carry loss: (hidden [M, H], labels [M], weights [M], slot [M]) from hidden
    [b, A, B, H], keeping slots with a label (slot ≥ 1, inside the sequence, real anchor)."""
    keep = blocks.labels != IGNORE
    slot = torch.arange(blocks.labels.shape[-1], device=hidden.device).expand_as(blocks.labels)
    return hidden[keep], blocks.labels[keep], weights.to(hidden.device)[slot[keep]], slot[keep]


def teacher_rows(final_hidden: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """The target's final-normed hidden state that predicts each loss row's label: for a label
    at position p, row p−1 of ``final_hidden`` [b, L, H] → [M, H] (rows as ``select_rows``)."""
    keep = blocks.labels != IGNORE
    b = torch.arange(blocks.labels.shape[0], device=final_hidden.device)[:, None, None].expand_as(blocks.labels)
    return final_hidden[b[keep], blocks.positions[keep] - 1]


def chunked_loss_backward(hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                          lm_head: torch.Tensor, chunk: int = 16384, backward: bool = True,
                          teacher: torch.Tensor | None = None, kl: float = 0.0) -> tuple[float, torch.Tensor]:
    """Weighted loss Σ w·ℓ / Σ w over rows, ℓ = (1−kl)·CE(hidden @ lm_headᵀ, labels) +
    kl·KL(p_target ‖ p_drafter) where p_target = softmax(teacher @ lm_headᵀ) (teacher [M, H], the
    target's final-normed hidden at the position before each label; needed when kl > 0).
    Computed (and back-propagated into ``hidden``'s graph when ``backward``) in row chunks so
    the [M, V] logits never exist whole. Returns (loss, argmax predictions [M] int64)."""
    h = hidden.detach().requires_grad_(backward)
    wsum = weights.sum().clamp(min=1e-6)
    total, preds = 0.0, []
    if kl > 0:
        chunk = max(1, chunk // 2)
    for s in range(0, h.shape[0], chunk):
        with torch.set_grad_enabled(backward):
            logits = (h[s:s + chunk].to(lm_head.dtype) @ lm_head.T).float()
            row = torch.zeros(logits.shape[0], device=logits.device)
            if kl < 1:
                row = row + (1 - kl) * F.cross_entropy(logits, labels[s:s + chunk], reduction="none")
            if kl > 0:
                with torch.no_grad():
                    logp_t = torch.log_softmax((teacher[s:s + chunk].to(lm_head.dtype) @ lm_head.T).float(), -1)
                logq = torch.log_softmax(logits, -1)
                row = row + kl * (logp_t.exp() * (logp_t - logq)).sum(-1)
            loss = (row * weights[s:s + chunk]).sum() / wsum
            if backward:
                loss.backward()
        total += float(loss.detach())
        preds.append(logits.detach().argmax(-1))
    if backward and h.shape[0]:
        hidden.backward(h.grad)
    return total, torch.cat(preds) if preds else labels.new_zeros(0)


def accept_lengths(preds: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """Chain acceptance per real anchor at T=0 on greedy data: the number of leading slots
    1…B−1 whose argmax equals the label (a slot without a label ends the run). preds [b, A, B]."""
    ok = (preds == blocks.labels) & (blocks.labels != IGNORE)
    run = ok[..., 1:].long().cumprod(-1).sum(-1)  # [b, A]
    return run[blocks.anchor_valid]
