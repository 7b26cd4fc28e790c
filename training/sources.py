"""Code prompts from the sources of permissively licensed PyPI wheels (plans/0008).

The wheels are fetched once on the CPU machine with ``pip download --no-deps --only-binary
:all: -d DIR <packages>`` (``CODE_PACKAGES``); each wheel's licence and version are read from
its ``METADATA`` and kept with the prompts. Three kinds of prompt are cut from the ``.py``
files with ``ast``:

- ``code_fn``: raw text — the module's import lines, then a function's signature and
  docstring (a method comes with its ``class`` line); the target continues with the body
  (the HumanEval prompt shape).
- ``code_window``: raw text — 12…60 consecutive lines starting at a top-level statement.
- ``code_instruct``: a chat turn — "write a function that <docstring summary>", "explain this
  code" or "write pytest tests for this function", with the function's source quoted.

All texts are plain ``str``; tokenising and the held-out filter happen in ``training.prompts``.
"""
from __future__ import annotations

import ast
import email
import pathlib
import random
import zipfile
from dataclasses import dataclass

# package → expected licence (checked against the wheel's METADATA by ``wheel_info``)
CODE_PACKAGES = {"networkx": "BSD-3-Clause", "more-itertools": "MIT", "boltons": "BSD", "click": "BSD-3-Clause",
                 "requests": "Apache-2.0", "attrs": "MIT", "rich": "MIT", "toolz": "BSD-3-Clause"}
PERMISSIVE = ("MIT", "BSD", "Apache")


@dataclass(frozen=True)
class Prompt:
    """One prompt text. kind: sharegpt | code_fn | code_window | code_instruct; chat: whether
    the chat template is applied; origin: 'package==version:path' or 'sharegpt'."""

    text: str
    kind: str
    chat: bool
    origin: str


def wheel_info(path: pathlib.Path) -> dict:
    """{name, version, license} from a wheel's METADATA (License-Expression, else License,
    else the License classifier). Raises ValueError for a licence that is not permissive."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.message_from_bytes(z.read(meta))
    lic = msg.get("License-Expression") or (msg.get("License") or "").strip()
    if not lic or len(lic) > 40:
        lic = next((c.split("::")[-1].strip() for c in msg.get_all("Classifier") or [] if c.startswith("License ::")),
                   "")
    if not any(p in lic for p in PERMISSIVE):
        raise ValueError(f"{path.name}: licence {lic!r} is not in the permissive list {PERMISSIVE}")
    return {"name": msg["Name"], "version": msg["Version"], "license": lic, "wheel": path.name}


def _imports(tree: ast.Module, lines: list[str]) -> list[str]:
    """Whole top-level import statements, at most 8 lines."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            stmt = lines[node.lineno - 1:node.end_lineno]
            if len(out) + len(stmt) > 8:
                break
            out.extend(stmt)
    return out


def _functions(tree: ast.Module):
    """(function node, enclosing class node or None) for top-level functions and methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, None
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield sub, node


def _summary(doc: str) -> str:
    """First paragraph of a docstring, on one line."""
    para = doc.strip().split("\n\n")[0]
    return " ".join(para.split())


def file_prompts(source: str, origin: str, rng: random.Random) -> list[Prompt]:
    """Prompts of every kind cut from one module's source (empty if it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    head = _imports(tree, lines)
    out = []
    for fn, cls in _functions(tree):
        doc = ast.get_docstring(fn)
        body = fn.body
        if not doc or len(body) < 2 or fn.end_lineno - fn.lineno < 5 or fn.name.startswith("test"):
            continue
        start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
        sig_doc = lines[start:body[0].end_lineno]  # signature through the end of the docstring
        cls_line = [lines[cls.lineno - 1]] if cls else []
        raw = "\n".join(head + ([""] if head else []) + cls_line + sig_doc) + "\n"
        out.append(Prompt(raw, "code_fn", False, origin))
        src = "\n".join(lines[start:fn.end_lineno])
        summary = _summary(doc)
        args = ast.unparse(fn.args)
        choice = rng.random()
        if choice < 0.45 and len(summary) > 20:
            text = f"Write a Python function `{fn.name}({args})` that does the following: {summary}"
        elif choice < 0.8:
            text = f"Explain what the following Python code does, step by step.\n\n```python\n{src}\n```"
        else:
            text = f"Write pytest unit tests for this Python function.\n\n```python\n{src}\n```"
        out.append(Prompt(text, "code_instruct", True, origin))
    starts = [n.lineno - 1 for n in tree.body]
    for s in rng.sample(starts, min(len(starts), 3)):
        n = rng.randint(12, 60)
        chunk = lines[s:s + n]
        if sum(bool(x.strip()) for x in chunk) >= 8:
            out.append(Prompt("\n".join(chunk) + "\n", "code_window", False, origin))
    return out


def code_prompts(wheel_dir: str | pathlib.Path, seed: int = 0) -> tuple[list[Prompt], list[dict]]:
    """All code prompts from the wheels in ``wheel_dir`` (sorted by name, deterministic for a
    seed). Returns (prompts, per-wheel provenance {name, version, license, wheel, files, prompts})."""
    rng = random.Random(seed)
    prompts, provenance = [], []
    for path in sorted(pathlib.Path(wheel_dir).glob("*.whl")):
        info = wheel_info(path)
        n0, files = len(prompts), 0
        with zipfile.ZipFile(path) as z:
            for name in sorted(z.namelist()):
                if not name.endswith(".py") or ".dist-info/" in name:
                    continue
                files += 1
                text = z.read(name).decode("utf-8", errors="replace")
                prompts += file_prompts(text, f"{info['name']}=={info['version']}:{name}", rng)
        provenance.append({**info, "files": files, "prompts": len(prompts) - n0})
    return prompts, provenance
