"""Lossless acceptance on a deterministic draft tree: sample-and-match. Pure Python
(torch-free): the orchestrator runs it on the target's per-node samples.

At each node v the target draws x_v ~ p_v (``modeling.sampling``); a child c of v is accepted
when tokens[c] == x_v and v itself was accepted. The deepest accepted node ends the path and
its sample is the bonus token. Every emitted token is a genuine target sample, so the output
follows the target distribution exactly (SpecInfer / DDTree; DOMAIN §4; greedy is the special
case x_v = argmax). Siblings carry distinct tokens, so at most one child matches.
"""
from __future__ import annotations


def resolve(tokens: list[int], parents: list[int], samples: list[int]) -> tuple[list[int], int]:
    """Walk from the root. tokens/parents/samples: flat tree of N+1 nodes (index 0 = root,
    parents[0] = -1, parents precede children), one target sample per node; ``parents`` a list
    or tuple (``index`` with a start). Returns (accepted path: node indices from the root, bonus
    token = sample at its end). Of two children with one token the first is taken. Only the
    nodes on the path are looked at: each step scans ``parents`` (in C) for the node's children
    after it, so a round costs O(path × N) comparisons and no per-node Python work."""
    path, v, n = [0], 0, len(tokens)
    while True:
        want, i = samples[v], v
        try:
            while tokens[i := parents.index(v, i + 1, n)] != want:
                pass
        except ValueError:  # no (further) child of v: v ends the path
            return path, want
        path.append(i)
        v = i


def path_probabilities(edge: list[float], parents: list[int]) -> list[float]:
    """P_target(path to v) for every node (root 1.0), from ``edge[v]`` = the processed target
    probability of node v's token at its parent (edge[0] ignored). Parents precede children."""
    prob = [1.0] * len(edge)
    for v in range(1, len(edge)):
        prob[v] = prob[parents[v]] * edge[v]
    return prob


def expected_accepted(edge: list[float], parents: list[int]) -> float:
    """Σ over non-root nodes of P_target(path to v): the expected number of accepted drafts
    (sample-and-match reaches this bound; no lossless verifier can exceed it)."""
    return sum(path_probabilities(edge, parents)[1:])
