"""Test-only references, kept out of production modules: the plain acceptance walk, and
teacher-forced checks of generated output against plain decoding (one causal forward over
prompt + output instead of a served autoregressive run). The literal heapq DDTree build, which
bench/ uses too, is ``draft_service.ddtree.build_ddtree_reference``.
"""
from __future__ import annotations

import torch

from modeling.llama import causal_mask
from modeling.sampling import SamplingParams, position_uniforms, processed_logprobs, sample

NEAR_TIE = 1e-4  # a mismatch closer than this to a decision boundary is numerics, not a bug


@torch.inference_mode()
def teacher_forced_logits(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    """[len(out), V] logits: row i is the target's prediction of out[i] after prompt + out[:i],
    from one causal forward (what plain decoding computes one token at a time)."""
    seq = torch.tensor(prompt + out[:-1])
    hidden, _ = model(seq, torch.arange(len(seq)), model.new_cache(len(seq)), causal_mask(0, len(seq)))
    return model.logits(hidden[len(prompt) - 1:])


def greedy_divergences(model, prompt: list[int], out: list[int]) -> tuple[int | None, int]:
    """Check `out` against plain greedy decoding. Returns (index of the first token that is not
    the argmax beyond a near-tie, or None; number of near-tie mismatches forgiven). Every token
    is checked given the output's own prefix, so a forgiven near-tie does not hide later ones."""
    logits = teacher_forced_logits(model, prompt, out).float()
    want = logits.argmax(-1)
    got = torch.tensor(out)
    gap = logits.gather(-1, want[:, None])[:, 0] - logits.gather(-1, got[:, None])[:, 0]
    bad = (want != got) & (gap >= NEAR_TIE * logits.abs().amax(-1).clamp(min=1.0))
    ties = int(((want != got) & ~bad).sum())
    return (int(bad.nonzero()[0]) if bad.any() else None), ties


def sampled_divergences(model, prompt: list[int], out: list[int], params: SamplingParams
                        ) -> tuple[int | None, int]:
    """Check `out` against seeded plain sampling (token i drawn at absolute position
    len(prompt) + i with ``modeling.sampling.sample``). Returns (first mismatch that is not a
    near-tie — the uniform within 1e-4 of a CDF boundary — or None; near-ties forgiven)."""
    logits = teacher_forced_logits(model, prompt, out)
    positions = len(prompt) + torch.arange(len(out))
    want = sample(logits, params, positions)
    ties = 0
    for i in (want != torch.tensor(out)).nonzero()[:, 0].tolist():
        cdf = processed_logprobs(logits[i:i + 1], params).exp().cumsum(-1)[0]
        u = float(position_uniforms(params.seed, positions[i:i + 1])[0]) * float(cdf[-1])
        if not bool(((cdf - u).abs() < 1e-4).any()):
            return i, ties
        ties += 1
    return None, ties


def accepted_mask(tokens: torch.Tensor, parents: torch.Tensor, visibility: torch.Tensor,
                  samples: torch.Tensor) -> torch.Tensor:
    """Batched sample-and-match (the vectorised form the χ² harness runs 10^5 times; equal to
    ``modeling.acceptance.resolve``, tested). tokens/parents [N+1] int64, visibility
    [N+1, N+1] bool, samples [..., N+1] int64. Returns [..., N+1] bool: on the accepted path."""
    parent_sample = samples[..., parents.clamp(min=0)]
    match = tokens == parent_sample
    match[..., 0] = True
    return ~(visibility & ~match[..., None, :]).any(-1)


def deepest_accepted(depths: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Index [...] int64 of the deepest accepted node (the accepted nodes form one path)."""
    return torch.where(accepted, depths, -1).argmax(-1)


def resolve_reference(tokens: list[int], parents: list[int], samples: list[int]) -> tuple[list[int], int]:
    """Plain walk from the root: the reference for ``modeling.acceptance.resolve``."""
    children: dict[int, list[int]] = {}
    for i in range(1, len(tokens)):
        children.setdefault(parents[i], []).append(i)
    path, v = [0], 0
    while True:
        nxt = [c for c in children.get(v, []) if tokens[c] == samples[v]]
        if not nxt:
            return path, samples[v]
        v = nxt[0]
        path.append(v)
