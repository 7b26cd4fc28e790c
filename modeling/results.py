"""Plain result types of the target's prefill and verify, shared by the target engine and the
orchestrator (which receives them through its gRPC worker client)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillOutput:
    first_token: int               # the first bonus token (sampled, not yet in the KV)
    features: torch.Tensor | None  # [T, taps*H] context features of the prompt, on CPU


@dataclass
class VerifyOutput:
    accepted_nodes: list[int]      # root (0) first, then the accepted path
    bonus_token: int               # target sample at the deepest accepted node
    node_samples: list[int]        # [N+1] one target sample per node
    expected_accepted: float       # sum over non-root nodes of P_target(path to node)
    features: torch.Tensor | None  # [len(accepted_nodes), taps*H] on CPU
