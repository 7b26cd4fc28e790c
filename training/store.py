"""Compact on-disk token stores (plans/0008): the prompt file and the data shards are ``.npz``
files of flat uint16 token ids (the SmolLM2 vocabulary has 49,152 ids) with int64 offsets, so
they travel through the device link cheaply (≤ 16 MiB per returned file) and load without pickle.

Prompt file arrays: tokens uint16 [T], offsets int64 [n+1], kind int8 [n] (index into
KINDS), meta (JSON string: provenance and counts).
Shard arrays: tokens uint16 [T] (prompt + response per sequence), offsets int64 [n+1],
prompt_lens int32 [n], temps float32 [n] (0 = greedy), job_ids int64 [n], meta (JSON string).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np
import torch

KINDS = ("sharegpt", "code_fn", "code_window", "code_instruct")
SHARD_BYTES = 15 * 2 ** 20  # a shard stays below the 16 MiB per-file limit of the device link


def _flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs])
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int64, count=int(offsets[-1]))
    if flat.size and (flat.min() < 0 or flat.max() > 65535):
        raise ValueError("token id outside uint16")
    return flat.astype(np.uint16), offsets


def _split(tokens: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    return [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def save_prompts(path, prompts: list[list[int]], kinds: list[str], meta: dict) -> None:
    """Write the prompt file (compressed)."""
    tokens, offsets = _flat(prompts)
    kind = np.array([KINDS.index(k) for k in kinds], dtype=np.int8)
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, tokens=tokens, offsets=offsets, kind=kind, meta=np.array(json.dumps(meta)))


def load_prompts(path) -> tuple[list[list[int]], list[str], dict]:
    """(prompts as int lists, kind names, meta) from a prompt file."""
    with np.load(path, allow_pickle=False) as z:
        seqs = [s.astype(np.int64).tolist() for s in _split(z["tokens"], z["offsets"])]
        return seqs, [KINDS[k] for k in z["kind"].tolist()], json.loads(str(z["meta"]))


def save_shard(path, seqs: list[list[int]], prompt_lens: list[int], temps: list[float], job_ids: list[int],
               meta: dict) -> None:
    """Write one data shard (uncompressed: ids barely compress and loading stays fast)."""
    tokens, offsets = _flat(seqs)
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, tokens=tokens, offsets=offsets, prompt_lens=np.asarray(prompt_lens, dtype=np.int32),
             temps=np.asarray(temps, dtype=np.float32), job_ids=np.asarray(job_ids, dtype=np.int64),
             meta=np.array(json.dumps(meta)))


def shard_paths(dirs) -> list[pathlib.Path]:
    """All ``shard-*.npz`` under the given directories, deduplicated by file name, sorted."""
    seen = {}
    for d in dirs:
        for p in sorted(pathlib.Path(d).glob("shard-*.npz")) if d and pathlib.Path(d).is_dir() else []:
            seen.setdefault(p.name, p)
    return [seen[k] for k in sorted(seen)]


def load_shards(paths) -> dict:
    """Training data from shards: {"tokens": [int32 tensor], "prompt_lens": [int], "temps":
    [float], "job_ids": [int]} in shard order; a job id seen twice keeps its first copy."""
    out = {"tokens": [], "prompt_lens": [], "temps": [], "job_ids": []}
    seen = set()
    for p in paths:
        with np.load(p, allow_pickle=False) as z:
            seqs = _split(z["tokens"], z["offsets"])
            for s, pl, t, j in zip(seqs, z["prompt_lens"].tolist(), z["temps"].tolist(), z["job_ids"].tolist()):
                if j in seen:
                    continue
                seen.add(j)
                out["tokens"].append(torch.from_numpy(s.astype(np.int32)))
                out["prompt_lens"].append(int(pl))
                out["temps"].append(float(t))
                out["job_ids"].append(int(j))
    return out


def done_jobs(paths) -> set[int]:
    """Job ids already present in the shards."""
    done = set()
    for p in paths:
        with np.load(p, allow_pickle=False) as z:
            done.update(z["job_ids"].tolist())
    return done
