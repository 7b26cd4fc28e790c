"""Plain types shared by the orchestrator, the engines and the wire layer. Torch-free and
protobuf-free: the orchestrator imports this, never tensors.

Terms (plans/0004): *accepted drafts* = tree nodes below the root on the accepted path;
*accept length* τ = accepted drafts + 1 = tokens a round commits (the bonus included);
*tree budget* = non-root nodes of a draft tree; *taps* = the target layers whose outputs form
the context features (DFlash ``target_layer_ids``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any


class InvalidRequest(ValueError):
    """Bad input (→ INVALID_ARGUMENT). The message names the field and the limit."""


class ResourceExhausted(RuntimeError):
    """Does not fit the configured capacity (→ RESOURCE_EXHAUSTED)."""


class UnknownRequest(KeyError):
    """No state for this request id (→ NOT_FOUND)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


class FailedPrecondition(RuntimeError):
    """The request's state does not allow this call (→ FAILED_PRECONDITION)."""


class Unavailable(RuntimeError):
    """The engine cannot serve any request until restarted, e.g. a tensor-parallel rank died
    (→ UNAVAILABLE)."""


class Mode(str, Enum):
    """Decoding mode of a request. A ``str`` enum: ``Mode.TREE == "tree"``."""

    AUTOREGRESSIVE = "autoregressive"
    CHAIN = "chain"   # the drafter's top-1 path
    TREE = "tree"     # DDTree best-first tree under the tree budget

    @property
    def speculative(self) -> bool:
        return self is not Mode.AUTOREGRESSIVE


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or top_k 1) = greedy argmax; top_k 0 = off; top_p 1.0 = off; seed keys
    the noise by (seed, absolute position) (the orchestrator draws one if the client gave none)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest naming the field and its limit."""
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise InvalidRequest(f"sampling.temperature must be a finite number >= 0, got {t}")
        if self.top_k < 0:
            raise InvalidRequest(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if vocab_size is not None and self.top_k > vocab_size:
            raise InvalidRequest(f"sampling.top_k must be <= vocab size {vocab_size}, got {self.top_k}")
        p = self.top_p
        if math.isnan(p) or not (0.0 < p <= 1.0):
            raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {p}")
        if not (0 <= self.seed < 2 ** 64):
            raise InvalidRequest(f"sampling.seed must be in [0, 2^64), got {self.seed}")


@dataclass
class Prefilled:
    """Target's answer to opening a request: the first bonus token (sampled, not yet in the
    KV) and the prompt's context features. ``features`` is opaque to the orchestrator: a
    ``torch.Tensor`` [T, taps·hidden] in process, a wire ``Tensor`` message over gRPC; it is
    handed to the drafter untouched (None when not asked for)."""

    first_token: int
    features: Any = None


@dataclass
class Verified:
    """Target's answer to a verify: per tree node (index 0 = root) the target's sample from
    the node's processed distribution, and ``edge_probs[v]`` = P(tokens[v]) under the parent's
    processed distribution (edge_probs[0] = 1). ``feature_nodes``: the nodes whose context
    features are attached (the sample-consistent path, root first); ``features`` opaque,
    [held_rows + len(feature_nodes), taps·hidden]: ``held_rows`` rows of earlier rounds the
    target held (verifies that asked it to hold their rows: their ``features`` None), oldest
    first, then the path's."""

    samples: list[int]
    edge_probs: list[float]
    feature_nodes: list[int]
    features: Any = None
    held_rows: int = 0
