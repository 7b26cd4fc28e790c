"""Structure of a flat draft token tree (DDTree layout: index 0 = root, parents[i] < i)."""
from __future__ import annotations

import numpy as np


def tree_ancestors(parents: list[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """depths [n] int64 and ancestors [n, max_depth + 1] int32 with ``ancestors[i, j]`` = the
    node on i's root path at depth j (j ≤ depths[i]; 0 beyond). Vectorised over nodes, one
    step per tree level. parents[0] must be -1 and parents[i] in [0, i)."""
    par = np.asarray(parents, dtype=np.int64).copy()
    n = par.shape[0]
    par[0] = 0
    depths = np.zeros(n, dtype=np.int64)
    cur = np.arange(n)
    while (cur != 0).any():
        depths += cur != 0
        cur = par[cur]
    anc = np.zeros((n, int(depths.max()) + 1), dtype=np.int32)
    cur, rows = np.arange(n), np.arange(n)
    for k in range(int(depths.max()) + 1):
        col = depths - k
        ok = col >= 0
        anc[rows[ok], col[ok]] = cur[ok]
        cur = par[cur]
    return depths, anc


def visibility(depths: np.ndarray, ancestors: np.ndarray) -> np.ndarray:
    """[n, n] bool visibility (ancestor) mask: [i, j] is True when j is i or an ancestor of i."""
    n = depths.shape[0]
    vis = np.zeros((n, n), dtype=bool)
    cols = np.arange(ancestors.shape[1])
    ok = cols[None, :] <= depths[:, None]
    rows = np.broadcast_to(np.arange(n)[:, None], ancestors.shape)
    vis[rows[ok], ancestors[ok]] = True
    return vis
