"""Held-out prompts: the prompts whose greedy answers measure held-out τ̂ (plans/0008, session 10).

A held-out *sequence* is not enough: a prompt's sampled answers share its prompt and long
stretches of its greedy answer, so training on them leaks the held-out set into training; and
a later session that regenerates the data gets new job ids, so a fresh held-out choice may
pick prompts an earlier session trained on (session 10's τ̂ favoured the shipped drafter for
that reason). So a prompt is identified by a hash of its token ids, every sequence of a held-out
prompt stays out of training, and the keys travel with an exported checkpoint
(``heldout_prompts.json``) so that the next lineage holds out the same prompts.
"""
from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

FILE = "heldout_prompts.json"


def prompt_key(tokens, prompt_len: int) -> str:
    """16 hex digits of the SHA-1 of the prompt's token ids (int32), ``tokens[:prompt_len]``."""
    ids = np.asarray(tokens[:prompt_len], dtype=np.int32)
    return hashlib.sha1(ids.tobytes()).hexdigest()[:16]


def prompt_keys(data: dict) -> list[str]:
    """Every sequence's prompt key, in data order (data as ``training.store.load_shards``)."""
    return [prompt_key(t, p) for t, p in zip(data["tokens"], data["prompt_lens"])]


def load(directory) -> set[str]:
    """The held-out prompt keys stored with a checkpoint; empty when it has none."""
    path = pathlib.Path(directory) / FILE
    return set(json.loads(path.read_text())["prompts"]) if path.exists() else set()


def save(directory, keys) -> None:
    """Write ``keys`` (sorted) as the checkpoint's held-out prompts."""
    path = pathlib.Path(directory) / FILE
    path.write_text(json.dumps({"note": "SHA-1 (16 hex) of the int32 token ids of each held-out prompt; "
                                        "training.heldout", "prompts": sorted(keys)}, indent=0))
