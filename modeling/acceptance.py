"""Lossless acceptance on a deterministic draft tree: sample-and-match.

At each node v the target draws x_v ~ p_v (``modeling.sampling``); a child c of v is accepted
when tokens[c] == x_v and v itself was accepted. The deepest accepted node ends the path and
its sample is the bonus token. Every emitted token is a genuine target sample, so the output
follows the target distribution exactly (SpecInfer / DDTree §4 of shared DOMAIN notes; greedy
is the special case x_v = argmax).
"""
from __future__ import annotations

import torch


def accepted_mask(tokens: torch.Tensor, parents: torch.Tensor, visibility: torch.Tensor,
                  samples: torch.Tensor) -> torch.Tensor:
    """Which nodes lie on the accepted path. tokens/parents [N+1] int64 (parents[0] = -1),
    visibility [N+1, N+1] bool, samples [..., N+1] int64 (batch dims allowed).
    Returns [..., N+1] bool; the root is always accepted."""
    parent_sample = samples[..., parents.clamp(min=0)]
    match = tokens == parent_sample
    match[..., 0] = True
    return ~(visibility & ~match[..., None, :]).any(-1)


def deepest_accepted(depths: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Index [...] int64 of the deepest accepted node (siblings carry distinct tokens, so the
    accepted nodes form one path)."""
    return torch.where(accepted, depths, -1).argmax(-1)


def resolve(tokens, parents, depths, visibility, samples) -> tuple[torch.Tensor, int]:
    """Batched tensor resolution for one tree: returns (path [k+1] int64 node indices from the
    root, bonus token)."""
    acc = accepted_mask(tokens, parents, visibility, samples)
    v = int(deepest_accepted(depths, acc))
    path = visibility[v].nonzero().squeeze(-1)  # ancestors in index order = path order
    return path, int(samples[v])


def path_probabilities(edge: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """P_target(path to v) [N+1] float64 for every node (root 1.0), from ``edge`` [N+1] float64,
    the processed target probability of each node's token at its parent (edge[0] ignored).
    The sum over non-root nodes is the expected number of accepted drafts (sample-and-match
    reaches this bound; no lossless verifier can exceed it)."""
    prob = edge.double().clone()
    prob[0] = 1.0
    for d in range(2, int(depths.max()) + 1 if depths.numel() > 1 else 0):
        prob = torch.where(depths == d, prob[parents.clamp(min=0)] * edge, prob)
    return prob
