"""Where τ collapses (issue 9 item 4): acceptance length τ against context length and language.

Each prompt is a window of a long document that ends at a line start (the *cut*); the model
continues the document from there (raw text, no chat template). For every cut the prompts of
all lengths (default 256, 2048 and 7936 tokens) are the last L tokens before the same cut, so
the continuation point is the same and only the amount of earlier context changes. Languages:

- ``en``: the Vim user manual (``usr_01.txt``…``usr_12.txt``, one book; licence OPL-1+ as
  packaged by Debian's vim-runtime) — English tutorial prose;
- ``zh``: the Chinese Vim tutor (``tutor.zh_cn.utf-8``, Vim licence) — the same kind of text
  (Vim tutorial prose) in Chinese;
- ``code``: Python 3.11 standard-library modules (PSF-2.0), one cut per file.

No HumanEval / MT-Bench item is used. The prompts are built once on a machine that has those
files (``--build``; token ids of the longest window per cut, uint16, plus provenance) and the
file travels with the repository (``bench/results/acceptance_context_prompts.npz``).

  python3 -m bench.acceptance_context --build                      # here: the prompt file
  python3 -m bench.acceptance_context --device cuda --out $OUT/ctx # H200: bf16, graphs
Output: ``<out>.json`` (per cell τ, per-request τ, P(accepted ≥ k)) and ``<out>.md`` (table:
rows language × length, columns modes). τ = mean over requests of tokens committed per verify
round (the orchestrator's own loop, in process, T=0 unless ``--temperature``).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np
import torch

from bench.acceptance import load_engines, measure

PROMPTS = pathlib.Path(__file__).resolve().parent / "results" / "acceptance_context_prompts.npz"
LENGTHS = (256, 2048, 7936)  # 7936 + 128 new tokens + the draft block stay within SmolLM2's 8192 positions
VIM = pathlib.Path("/usr/share/vim/vim90")


def _sources() -> dict[str, list[tuple[str, str]]]:
    """{language: [(name, text)]} from this machine's files (see the module docstring)."""
    import sysconfig

    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    book = "".join((VIM / "doc" / f"usr_{i:02d}.txt").read_text(encoding="utf-8") for i in range(1, 13))
    code = ["argparse", "typing", "inspect", "tarfile", "subprocess", "enum", "dataclasses", "shutil", "pathlib",
            "zipfile/__init__", "functools", "logging/__init__"]
    return {"en": [("vim doc usr_01..usr_12.txt", book)],
            "zh": [("vim tutor.zh_cn.utf-8", (VIM / "tutor" / "tutor.zh_cn.utf-8").read_text(encoding="utf-8"))],
            "code": [(f"python{sys.version_info[0]}.{sys.version_info[1]} stdlib {m}.py",
                      (lib / f"{m}.py").read_text(encoding="utf-8")) for m in code if (lib / f"{m}.py").exists()]}


def _cut_points(tok, text: str, need: int, k: int) -> list[int]:
    """``k`` character offsets of line starts, evenly spread over those with ≥ ``need`` tokens
    before them and a non-blank line after them (binary search on the line index)."""
    starts = [i + 1 for i, ch in enumerate(text) if ch == "\n" and text[i + 1:i + 2].strip()]
    lo, hi = 0, len(starts)
    while lo < hi:  # first line start with enough tokens before it
        mid = (lo + hi) // 2
        if len(tok.encode(text[:starts[mid]])) >= need:
            hi = mid
        else:
            lo = mid + 1
    valid = starts[lo:-20] or starts[lo:]  # leave room for the continuation
    if not valid:
        return []
    return [valid[round(j * (len(valid) - 1) / max(1, k - 1))] for j in range(k)] if k > 1 else [valid[len(valid) // 2]]


def build(tok, n: int, longest: int, path: pathlib.Path) -> dict:
    """Write ``path``: per language ``n`` windows of ``longest`` tokens ending at a cut (uint16),
    plus provenance (source name, character offset of the cut) in ``meta``."""
    arrays, meta = {}, {"longest": longest, "python": sys.version.split()[0], "langs": {}}
    for lang, docs in _sources().items():
        per_doc = max(1, -(-n // len(docs)))
        rows, prov = [], []
        for name, text in docs:
            for c in _cut_points(tok, text, longest, per_doc):
                ids = tok.encode(text[:c])[-longest:]
                rows.append(ids)
                prov.append({"source": name, "cut_char": c, "next_line": text[c:text.find("\n", c)][:80]})
        rows, prov = rows[:n], prov[:n]
        arrays[lang] = np.asarray(rows, dtype=np.uint16)
        meta["langs"][lang] = prov
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return meta


def load_prompts(path=PROMPTS) -> tuple[dict[str, np.ndarray], dict]:
    """({language: uint16 [n, longest]}, meta) from a file written by ``build``."""
    z = np.load(path)
    meta = json.loads(bytes(z["meta"]).decode())
    return {k: z[k] for k in z.files if k != "meta"}, meta


def to_markdown(res: dict) -> str:
    m = res["meta"]
    modes = m["modes"]
    window = f"draft context window {m['draft_window']} rows" if m.get("draft_window") else "full draft context"
    lines = [f"# τ against context length and language — {m['drafter']}", "",
             f"{m['where']}; {window}; {m['temperature_note']}; {m['n']} prompts per cell (the same cuts at every length), "
             f"{m['max_new']} new tokens; raw continuation of the document at a line start. "
             "τ = mean over requests of tokens committed per verify round; in brackets the min–max over requests.", "",
             "| language | prompt tokens | " + " | ".join(f"τ {x}" for x in modes) + " |",
             "|---|---|" + "---|" * len(modes)]
    for lang in m["langs"]:
        for L in m["lengths"]:
            cells = []
            for x in modes:
                r = res["results"].get(f"{lang}/{L}/{x}")
                cells.append(f"{r['tau']:.2f} ({min(r['tau_per_request']):.2f}–{max(r['tau_per_request']):.2f})"
                             if r else "–")
            lines.append(f"| {lang} | {L} | " + " | ".join(cells) + " |")
    prov = "; ".join(f"{lang}: {', '.join(sorted({p['source'] for p in ps}))}" for lang, ps in m["provenance"].items())
    return "\n".join(lines) + f"\n\nSources: {prov}.\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python3 -m bench.acceptance_context")
    ap.add_argument("--build", action="store_true", help="write the prompt file from this machine's sources")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--n", type=int, default=8, help="cuts per language")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--langs", default="en,zh,code")
    ap.add_argument("--modes", default="chain,tree@64")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fast", default="", help="engine fast path (default: graphs on CUDA, off on CPU)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-window", type=int, default=0,
                    help="the drafter's context window in rows (0 = the full context; whole pages)")
    ap.add_argument("--out", default=str(PROMPTS.parent / "acceptance_context"), help="results file stem")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.build:
        from modeling.tokenizer import TextTokenizer
        from modeling.weights import default_gguf_path

        tok = TextTokenizer.from_file(a.gguf or default_gguf_path())
        meta = build(tok, a.n, max(lengths), pathlib.Path(a.prompts))
        return print(json.dumps(meta, indent=1, ensure_ascii=False))
    prompts, pmeta = load_prompts(a.prompts)
    if max(lengths) > pmeta["longest"]:
        raise SystemExit(f"--lengths {max(lengths)} exceeds the prompt file's windows ({pmeta['longest']} tokens)")
    cuda = a.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    fast = a.fast or ("graphs" if cuda else "off")
    modes = a.modes.split(",")
    budgets = [int(x.split("@")[1]) for x in modes if x.startswith("tree@")]
    t0 = time.time()
    te, de, tok = load_engines(a.drafter, max(budgets + [32]), a.device, dtype, a.gguf, fast=fast,
                               max_context=max(lengths) + a.max_new + 64, draft_window=a.draft_window)
    print(f"engines loaded in {time.time() - t0:.1f} s ({a.device}, {dtype}, fast={fast})", flush=True)
    eos = tuple(tok.eos_token_ids)
    langs = [x for x in a.langs.split(",") if x in prompts]
    res = {"meta": {"drafter": str(a.drafter or "checkpoints/dflash-smollm2-135m"), "started": time.time(),
                    "draft_window": a.draft_window,
                    "where": (torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)")
                    + f", {str(dtype).replace('torch.', '')}, in-process engines (fast={fast})",
                    "temperature": a.temperature, "seed": a.seed,
                    "temperature_note": f"T={a.temperature:g}, seed {a.seed}+request" if a.temperature else "T=0 (greedy)",
                    "n": a.n, "max_new": a.max_new, "lengths": lengths, "modes": modes, "langs": langs,
                    "provenance": {k: pmeta["langs"][k][:a.n] for k in langs}, "python_of_sources": pmeta["python"]},
           "results": {}}
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for x in modes:
        mode, budget = ("chain", 0) if x == "chain" else ("tree", int(x.split("@")[1]))
        for lang in langs:
            for L in lengths:
                ps = [[int(t) for t in row[-L:]] for row in prompts[lang][:a.n]]
                r = measure(te, de, tok, ps, a.max_new, mode, budget, eos, a.temperature, a.seed)
                res["results"][f"{lang}/{L}/{x}"] = r
                print(f"{lang:5s} {L:5d} {x:8s} tau {r['tau']:.3f} {r['tau_per_request']} ({r['seconds']} s)", flush=True)
                out.with_suffix(".json").write_text(json.dumps(res, indent=1, ensure_ascii=False))
                out.with_suffix(".md").write_text(to_markdown(res))
    res["meta"]["seconds"] = round(time.time() - t0, 1)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, ensure_ascii=False))
    out.with_suffix(".md").write_text(to_markdown(res))
    print(to_markdown(res))


if __name__ == "__main__":
    main()
