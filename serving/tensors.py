"""torch.Tensor ⇄ specdec.v1.Tensor (raw little-endian row-major bytes + dtype + shape)."""
from __future__ import annotations

import math

import numpy as np
import torch

from modeling.errors import InvalidRequest
from specdec_proto.v1 import common_pb2

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    t = t.detach().contiguous().cpu()
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {t.dtype}")
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return common_pb2.Tensor(dtype=name, shape=list(t.shape), data=raw.numpy().tobytes())


def from_proto(msg: common_pb2.Tensor, field: str = "tensor") -> torch.Tensor:
    """Raises InvalidRequest naming ``field`` on an unknown dtype or a size mismatch."""
    if msg.dtype not in _DTYPES:
        raise InvalidRequest(f"{field}.dtype must be one of {sorted(_DTYPES)}, got {msg.dtype!r}")
    dtype = _DTYPES[msg.dtype]
    shape = list(msg.shape)
    n = math.prod(shape)  # Python ints: no overflow
    if any(s < 0 for s in shape) or n * torch.tensor([], dtype=dtype).element_size() != len(msg.data):
        raise InvalidRequest(f"{field}: {len(msg.data)} bytes do not match shape {shape} of {msg.dtype}")
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    np_dtype = np.int16 if dtype == torch.bfloat16 else np.dtype(msg.dtype)
    t = torch.from_numpy(np.frombuffer(msg.data, dtype=np_dtype).copy()).reshape(shape)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
