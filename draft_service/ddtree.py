"""Dynamic draft trees (DDTree) built from a drafter's per-depth logits.

Source: DDTree, "Drafting via dynamic trees" (reference code: liranringel/ddtree); see
DOMAIN.md section 3. The drafter's distributions at depths 1..D are treated as independent,
so the score of a prefix (t_1, ..., t_d) is sum_k log q_k(t_k). The tree that maximises the
expected accepted depth under that surrogate is the set of the `budget` most probable
prefixes. It is prefix-closed (a child never scores above its parent, since log-probs <= 0),
and it is what a best-first search over (depth, rank) pops, in pop order.

Three builders live here:

* `build_ddtree`: batched torch version (no per-node Python loop). Per depth it keeps a beam
  of the best `budget` prefixes (a top-`budget` prefix of depth d always extends a
  top-`budget` prefix of depth d-1), then takes the global best `budget` prefixes over all
  depths with a stable descending sort over the depth-major concatenation, which is the
  best-first pop order when scores have no exact ties.
* `build_chain`: the top-1 path (chain drafting), i.e. the same builder with K = 1.
* `build_ddtree_reference`: the literal heapq best-first search for one request (numpy), the
  reference of the other builders and of the GPU kernel ``specdec_kernels.ddtree_build``.

Precision: log-probs are `torch.log_softmax` in float32 over the full vocabulary (clamped to
<= 0) in every builder, and cumulative scores are accumulated in float32 depth by depth, so
the torch and reference builders see bit-identical scores. With exact score ties, both
produce a valid best-first tree but may order (or, at the budget boundary, pick) tied
prefixes differently.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from numbers import Integral

import numpy as np
import torch


@dataclass(frozen=True, eq=False)  # tensor fields: compare field by field, not with ==
class DraftTree:
    """Flat draft token tree. Index 0 is the root (the bonus token); nodes 1..N follow in
    best-first (pop) order, so parents precede children.

    tokens:     [N+1] int64; tokens[0] = root token.
    parents:    [N+1] int64; parents[0] = -1; parents[i] in [0, i) for i >= 1.
    depths:     [N+1] int64; depths[0] = 0; depths[i] = depths[parents[i]] + 1.
    visibility: [N+1, N+1] bool; visibility[i, j] = j is an ancestor of i or j == i
                (the root is an ancestor of every node); None if built with visibility=False.
    scores:     [N+1] float32; cumulative draft log-prob of the path to each node (root 0.0).

    The reference (`build_ddtree_reference`) returns the same class holding numpy arrays.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    visibility: torch.Tensor
    scores: torch.Tensor


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] float (any dtype) -> [..., V] float32 log_softmax over V, clamped to <= 0."""
    return torch.log_softmax(logits.float(), dim=-1).clamp_max(0.0)


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _check_inputs(draft_logits: torch.Tensor, root_tokens: torch.Tensor) -> torch.Tensor:
    if not isinstance(draft_logits, torch.Tensor) or draft_logits.dim() != 3:
        raise ValueError("draft_logits must be a [R, D, V] tensor")
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be floating point, got {draft_logits.dtype}")
    if min(draft_logits.shape) < 1:
        raise ValueError(f"draft_logits must have R, D, V >= 1, got {tuple(draft_logits.shape)}")
    root_tokens = torch.as_tensor(root_tokens, device=draft_logits.device)
    if root_tokens.shape != (draft_logits.shape[0],) or root_tokens.is_floating_point():
        raise ValueError(f"root_tokens must be an integer [R={draft_logits.shape[0]}] tensor")
    return root_tokens.long()


def _build(draft_logits: torch.Tensor, root_tokens: torch.Tensor, budget: int, k: int,
           visibility: bool = True) -> list[DraftTree]:
    """Best `budget` prefixes using the top-`k` tokens per depth; see `build_ddtree`."""
    R, D, _ = draft_logits.shape
    dev = draft_logits.device
    top_lp, top_ids = _log_probs(draft_logits).topk(k, dim=-1)  # [R, D, k], sorted desc

    # Per-depth beams; `par` holds the parent's index in the depth-major concatenation
    # of all beams (-1 = the root).
    score, tok = top_lp[:, 0], top_ids[:, 0]  # [R, k]
    par = torch.full_like(tok, -1)
    beams, offset = [(score, tok, par, 1)], 0
    for d in range(1, D):
        width = score.shape[1]
        cand = (score[:, :, None] + top_lp[:, d, None, :]).reshape(R, width * k)
        score, idx = cand.topk(min(budget, width * k), dim=1)  # sorted desc
        tok = top_ids[:, d].gather(1, idx % k)
        par = idx // k + offset
        offset += width
        beams.append((score, tok, par, d + 1))

    score = torch.cat([b[0] for b in beams], dim=1)  # [R, M]
    tok = torch.cat([b[1] for b in beams], dim=1)
    par = torch.cat([b[2] for b in beams], dim=1)
    depth = torch.cat([torch.full((b[0].shape[1],), b[3], device=dev) for b in beams])
    M = score.shape[1]
    N = min(budget, M)

    # Global best-N; stable over the depth-major order so a parent precedes an equal child.
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :N]  # [R, N]
    node_of = torch.full((R, M), -1, dtype=torch.long, device=dev)  # entry -> node index
    node_of.scatter_(1, order, torch.arange(1, N + 1, device=dev).expand(R, N))
    p = par.gather(1, order)
    node_par = torch.where(p < 0, 0, node_of.gather(1, p.clamp_min(0)))

    head = torch.zeros(R, 1, dtype=torch.long, device=dev)
    tokens = torch.cat([root_tokens[:, None], tok.gather(1, order)], dim=1)  # [R, N+1]
    parents = torch.cat([head - 1, node_par], dim=1)
    depths = torch.cat([head, depth[order]], dim=1)
    scores = torch.cat([head.float(), score.gather(1, order)], dim=1)

    if not visibility:
        return [DraftTree(tokens[r], parents[r], depths[r], None, scores[r]) for r in range(R)]
    # Visibility: walk every node up D times (the root is its own parent for the walk).
    up = parents.clamp_min(0)
    vis = torch.eye(N + 1, dtype=torch.bool, device=dev).repeat(R, 1, 1)
    cur = torch.arange(N + 1, device=dev).expand(R, N + 1)
    for _ in range(D):
        cur = up.gather(1, cur)
        vis.scatter_(2, cur[:, :, None], True)
    return [DraftTree(tokens[r], parents[r], depths[r], vis[r], scores[r]) for r in range(R)]


def build_ddtree(draft_logits: torch.Tensor, root_tokens: torch.Tensor, budget: int,
                 visibility: bool = True) -> list[DraftTree]:
    """Build one DDTree per request: the `budget` most probable prefixes, in best-first order.

    draft_logits: [R, D, V] float tensor (any float dtype; computed in float32), the drafter's
        logits at depths 1..D for R requests.
    root_tokens: [R] integer tensor, the root (bonus) token of each tree.
    budget: number of non-root nodes, >= 1.
    Returns R `DraftTree`s on draft_logits.device, each with
    N = min(budget, sum_{d=1..D} K**d) nodes, K = min(budget, V).
    Cost per depth is a top-k over budget * K candidates per request. visibility=False leaves
    `DraftTree.visibility` None (callers that only send tokens/parents skip D gathers).
    Raises ValueError for budget < 1 (or not an int) or bad shapes/dtypes.
    """
    budget = _check_count(budget, "budget")
    root_tokens = _check_inputs(draft_logits, root_tokens)
    return _build(draft_logits, root_tokens, budget, min(budget, draft_logits.shape[2]), visibility)


def build_chain(draft_logits: torch.Tensor, root_tokens: torch.Tensor, length: int | None = None,
                visibility: bool = True) -> list[DraftTree]:
    """Chain drafting: the top-1 (argmax) token at depths 1..length, one path per request.

    Same inputs as `build_ddtree`; length defaults to D and must satisfy 1 <= length <= D.
    Equals the DDTree build with K = 1 (node i sits at depth i, parent i - 1).
    Raises ValueError for a bad length or bad shapes/dtypes.
    """
    root_tokens = _check_inputs(draft_logits, root_tokens)
    D = draft_logits.shape[1]
    length = _check_count(D if length is None else length, "length")
    if length > D:
        raise ValueError(f"length {length} exceeds the draft depth D={D}")
    return _build(draft_logits, root_tokens, length, 1, visibility)


def build_ddtree_reference(draft_logits: np.ndarray, root_token: int, budget: int) -> DraftTree:
    """Literal best-first DDTree build for ONE request (DOMAIN.md section 3): the reference the
    batched builder and the one-launch kernel (``specdec_kernels.ddtree_build``) are checked against
    (tests, ``bench.ddtree_kernel``); a Python heap, not for serving.

    draft_logits: [D, V] float array. Log-probs are float32 `torch.log_softmax` over the full
    vocabulary (same helper as `build_ddtree`); scores accumulate in float32.
    Per depth, take the top-K ids (K = min(budget, V)). A max-heap on cumulative log-prob is
    seeded with (depth 1, rank 0); each pop becomes the next node, then pushes its next
    sibling (same depth and parent, rank + 1, if rank + 1 < K) and its first child
    (depth + 1, rank 0, if depth < D). Stops at `budget` nodes or an empty heap.
    Exact score ties pop in push order.
    Returns a `DraftTree` whose fields are numpy arrays (same shapes/dtypes as the torch one).
    Raises ValueError for budget < 1 or bad shapes.
    """
    budget = _check_count(budget, "budget")
    logits = np.asarray(draft_logits)
    if logits.ndim != 2 or min(logits.shape) < 1 or not np.issubdtype(logits.dtype, np.floating):
        raise ValueError("draft_logits must be a float [D, V] array with D, V >= 1")
    D, V = logits.shape
    K = min(budget, V)
    lp = _log_probs(torch.from_numpy(np.ascontiguousarray(logits))).numpy()  # [D, V] float32
    ranked = np.argsort(-lp, axis=1, kind="stable")[:, :K]  # [D, K] token ids, best first

    tokens, parents, depths, scores = [int(root_token)], [-1], [0], [np.float32(0.0)]
    counter = itertools.count()
    heap = []

    def push(depth: int, rank: int, parent: int) -> None:
        s = np.float32(scores[parent] + lp[depth - 1, ranked[depth - 1, rank]])
        heapq.heappush(heap, (-float(s), next(counter), depth, rank, parent, s))

    push(1, 0, 0)
    while heap and len(tokens) - 1 < budget:
        _, _, depth, rank, parent, s = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(int(ranked[depth - 1, rank]))
        parents.append(parent)
        depths.append(depth)
        scores.append(s)
        if rank + 1 < K:
            push(depth, rank + 1, parent)
        if depth < D:
            push(depth + 1, 0, node)

    n = len(tokens)
    vis = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            vis[i, j] = True
            j = parents[j]
    return DraftTree(
        tokens=np.array(tokens, dtype=np.int64),
        parents=np.array(parents, dtype=np.int64),
        depths=np.array(depths, dtype=np.int64),
        visibility=vis,
        scores=np.array(scores, dtype=np.float32),
    )
