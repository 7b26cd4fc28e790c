"""A request's recent context-feature rows, kept so that a new draft session can be given context.

The target sends context features with every reply (prefill: one row per prompt token; verify:
one row per node of the accepted path). The orchestrator never decodes them: over gRPC they
are ``specdec.v1.Tensor`` messages ([n, taps·hidden] row-major bytes), in process torch tensors
([n, taps·hidden]). ``FeatureTail`` keeps the newest parts and hands back the last ``n`` rows as
one block; rows are cut and joined as bytes (a message) or with torch (a tensor; torch is
imported only then, so the served orchestrator stays torch-free).

Bound: at most ``max(2 · keep, rows of the newest part)`` rows are held (the newest part is
always whole: its rows are the ones the live draft session has not seen yet).
"""
from __future__ import annotations

from collections import deque
from typing import Any


def rows(f: Any) -> int:
    """Rows of a feature block (message or tensor)."""
    return int(f.shape[0])


def last_rows(f: Any, n: int) -> Any:
    """The last ``n`` rows of ``f`` (``f`` itself when that is all of it)."""
    total = rows(f)
    if n == total:
        return f
    if hasattr(f, "SerializeToString"):  # a Tensor message: rows are equal byte slices
        width = len(f.data) // total if total else 0
        return type(f)(dtype=f.dtype, shape=[n, *f.shape[1:]], data=f.data[len(f.data) - n * width:])
    return f[total - n:]


def join(parts: list) -> Any:
    """Concatenate feature blocks along rows (one part: returned untouched)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if hasattr(first, "SerializeToString"):
        return type(first)(dtype=first.dtype, shape=[sum(rows(p) for p in parts), *first.shape[1:]],
                           data=b"".join(p.data for p in parts))
    import torch

    return torch.cat(parts)


class FeatureTail:
    """The newest feature rows of one request, about ``keep`` of them (see the module bound)."""

    def __init__(self, keep: int):
        self.keep = keep
        self.parts: deque = deque()
        self.rows = 0

    def add(self, f: Any) -> None:
        """Append the rows of newly committed tokens (None: nothing came)."""
        if f is None or rows(f) == 0:
            return
        self.parts.append(f)
        self.rows += rows(f)
        while len(self.parts) > 1 and self.rows - rows(self.parts[0]) >= self.keep:
            self.rows -= rows(self.parts.popleft())
        if len(self.parts) > 1 and self.rows > 2 * self.keep:  # cut the oldest part (amortised: once per keep rows)
            cut = rows(self.parts[0]) - (self.rows - self.keep)
            self.parts[0] = last_rows(self.parts[0], cut)
            self.rows = self.keep

    def clear(self) -> None:
        """Forget every row (the next rows are not contiguous with them)."""
        self.parts.clear()
        self.rows = 0

    def last(self, n: int) -> Any:
        """The last ``n`` rows (n <= self.rows) as one block."""
        if n > self.rows:
            raise ValueError(f"only {self.rows} feature rows are kept, {n} asked")
        picked, need = [], n
        for p in reversed(self.parts):
            if need == 0:
                break
            k = min(need, rows(p))
            picked.append(last_rows(p, k))
            need -= k
        return join(picked[::-1])
