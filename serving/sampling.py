"""specdec.v1.SamplingParams → modeling.sampling.SamplingParams, refusing what is unsupported."""
from __future__ import annotations

import random

from modeling.errors import InvalidRequest
from modeling.sampling import SamplingParams
from specdec_proto.v1 import common_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams, field: str = "sampling",
                        draw_seed: bool = False) -> SamplingParams:
    """Convert; top_p 0 reads as 1.0 (off). A missing seed becomes 0, or a fresh random 64-bit
    seed with ``draw_seed``. Raises InvalidRequest for min_p and the penalties (not supported:
    refused rather than silently ignored)."""
    if msg.min_p != 0:
        raise InvalidRequest(f"{field}.min_p is not supported; it must be 0, got {msg.min_p}")
    if msg.repetition_penalty not in (0.0, 1.0):
        raise InvalidRequest(f"{field}.repetition_penalty is not supported; it must be 0 or 1, "
                             f"got {msg.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(msg, name) != 0:
            raise InvalidRequest(f"{field}.{name} is not supported; it must be 0, got {getattr(msg, name)}")
    seed = msg.seed if msg.HasField("seed") else (random.getrandbits(64) if draw_seed else 0)
    return SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p or 1.0, seed=seed)
