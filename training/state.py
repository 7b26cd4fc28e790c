"""Training state on disk in parts that fit the device link (plans/0008).

A state is (tensors, meta): tensors (weights, bf16 moments, generator states) serialised as
one safetensors blob cut into ``state.partNNN`` files of ≤ ``PART_BYTES``, and ``state.json`` =
meta (JSON: configuration, step, schedule, data order, RNG states, curves) + the parts' sizes
and SHA-256. Loading checks every part before decoding, so a missing or damaged part is an
error naming it, never a silently different state.
"""
from __future__ import annotations

import hashlib
import json
import pathlib

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

PART_BYTES = 16 * 2 ** 20 - 2 ** 16


def save_state(directory, tensors: dict[str, torch.Tensor], meta: dict, part_bytes: int = PART_BYTES) -> list[str]:
    """Write ``state.json`` + parts into ``directory`` (stale parts removed). Returns the file names."""
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    blob = st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
    parts = []
    for old in d.glob("state.part*"):
        old.unlink()
    for i, s in enumerate(range(0, len(blob), part_bytes)):
        chunk = blob[s:s + part_bytes]
        name = f"state.part{i:03d}"
        (d / name).write_bytes(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    (d / "state.json").write_text(json.dumps({"meta": meta, "parts": parts}, indent=1))
    return ["state.json"] + [p["name"] for p in parts]


def load_state(directory) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors on CPU, meta) from ``directory``. Raises FileNotFoundError / ValueError naming
    the missing or damaged part."""
    d = pathlib.Path(directory)
    index = json.loads((d / "state.json").read_text())
    blob = bytearray()
    for p in index["parts"]:
        path = d / p["name"]
        if not path.exists():
            raise FileNotFoundError(f"training state part {path} is missing")
        chunk = path.read_bytes()
        if len(chunk) != p["bytes"] or hashlib.sha256(chunk).hexdigest() != p["sha256"]:
            raise ValueError(f"training state part {path} is damaged (size or sha256 differs)")
        blob += chunk
    return st_load(bytes(blob)), index["meta"]


def has_state(directory) -> bool:
    return directory is not None and (pathlib.Path(directory) / "state.json").exists()
