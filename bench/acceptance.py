"""Acceptance length τ of the shipped DFlash drafter (plans/0002), in-process on CPU.

Runs the orchestrator's own round loop (``orchestrator.generation``) over the engines in process
(TargetEngine + DraftEngine, fp32, greedy T=0); τ per request = mean over rounds of tokens
emitted per verify (accepted drafts + 1); the table reports the mean
over requests (DFlash's definition) for chain mode and DDTree budgets, on held-out HumanEval
(raw code, ``prompt=``) and MT-Bench (chat template) prompts, plus the per-position acceptance
P(accepted drafts ≥ k) from the pooled accept-length histogram.

  python -m bench.acceptance [--n 10] [--max-new 128] [--budgets 64,4,8,16,32,128,256] [--threads 1]
Writes bench/results/acceptance.json and .md. ``--sets humaneval`` / ``--sets mtbench`` run one
set (into acceptance-<set>.json, e.g. in two processes); ``--merge`` then combines them. Any other
choice of sets (humaneval, mtbench, stdlib) writes acceptance-<set>-<set>….json.
Two drafters compared (one process each, then a side-by-side table):
  python -m bench.acceptance --n 8 --max-new 64 --budgets 64 --no-extra-budgets --out /tmp/a/shipped
  python -m bench.acceptance ... --drafter DIR --out /tmp/a/new
  python -m bench.acceptance --table shipped=/tmp/a/shipped.json,new=/tmp/a/new.json --out acceptance_session3
Sampled acceptance: ``--temperature 1`` (top-k/top-p off; request i draws with seed ``--seed``+i,
so a rerun repeats it); the verify step is the lossless sampler, so τ is the served one.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from modeling.sampling import SamplingParams

GREEDY = SamplingParams()
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def load_engines(drafter_dir=None, max_budget: int = 256, device="cpu", dtype=torch.float32, gguf=None,
                 model=None, fast: str = "off", max_context: int = 4096, draft_window: int = 0):
    """(TargetEngine, DraftEngine, tokenizer) for the target (``gguf``, default the embedded
    one; or an already loaded ``model``) and the shipped drafter (or ``drafter_dir``), in
    ``dtype`` on ``device`` (float32 on CPU by default; bf16 on a GPU is the serving dtype).
    ``max_context``: positions per request in both engines (prompt + new tokens + a block);
    ``draft_window``: the drafter's context window in rows (``DraftEngine(window=)``, 0 = full)."""
    from draft_service.engine import DraftEngine
    from modeling.defaults import DEFAULT_DRAFTER_DIR
    from modeling.dflash import DFlashDrafter
    from modeling.llama import LlamaModel
    from modeling.tokenizer import TextTokenizer
    from modeling.weights import default_gguf_path, load_target
    from target_service.engine import TargetEngine

    if model is None:
        cfg, state = load_target(gguf)
        model = LlamaModel.from_state_dict(cfg, state, device, dtype)
    drafter = DFlashDrafter.load(drafter_dir or DEFAULT_DRAFTER_DIR).to(device, dtype).eval().requires_grad_(False)
    embed = model.model.embed_tokens.weight
    de = DraftEngine(drafter, embed, model.lm_head.weight, max_budget, max_context=max(max_context, 8192), fast=fast,
                     window=draft_window)
    te = TargetEngine(model, tuple(drafter.config.target_layer_ids), max_context=max_context,
                      kv_pool_tokens=1 << 16, max_tree_budget=max_budget, fast=fast)
    return te, de, TextTokenizer.from_file(gguf or default_gguf_path())


def compare(drafters: dict[str, str], model, gguf, n: int, max_new: int, modes: list[tuple[str, int]],
            device="cuda", dtype=torch.bfloat16, fast: str = "off", log=print) -> dict:
    """τ of several drafters on the same held-out prompts, in process: {drafter name:
    {"set/mode": measure(...)}} for modes [("chain", 0), ("tree", budget), ...] at T=0."""
    out = {}
    for name, directory in drafters.items():
        te, de, tok = load_engines(directory, max([b for _, b in modes] + [32]), device, dtype, gguf, model, fast)
        eos = tuple(tok.eos_token_ids)
        res = out[name] = {}
        for mode, budget in modes:
            for s, prompts in prompt_sets(tok, n).items():
                key = f"{s}/{mode}" + (f"@{budget}" if mode == "tree" else "")
                res[key] = measure(te, de, tok, prompts, max_new, mode, budget, eos)
                log(f"accept {name} {key}: tau {res[key]['tau']:.3f} ({res[key]['seconds']} s)")
    return out


def generate(te, de, tok, prompt: list[int], max_new: int, mode: str, budget: int = 0,
             eos: tuple[int, ...] = (), request_id: str = "bench",
             sampling: SamplingParams = GREEDY) -> tuple[list[int], list[int]]:
    """Generation of up to ``max_new`` tokens (stops after EOS; greedy unless ``sampling``)
    through the orchestrator's own round loop in process. mode: "chain", "tree" or
    "autoregressive". Returns (tokens, tokens emitted per verify round)."""
    from deploy.inprocess import InProcessDraft, InProcessTarget, run
    from orchestrator.generation import GenerationRequest

    req = GenerationRequest(request_id, prompt, max_new, mode=mode, tree_budget=budget or 1,
                            stop_token_ids=set(eos), sampling=sampling)
    r = run(req, tok, InProcessTarget(te), InProcessDraft(de) if mode != "autoregressive" else None)
    hist = r.finished.stats.histogram
    return r.token_ids, [k for k, n in enumerate(hist) for _ in range(n)]


def prompt_sets(tokenizer, n: int, sets=("humaneval", "mtbench")) -> dict[str, list[list[int]]]:
    """Held-out prompts of ``sets``, in that order: the first n HumanEval prompts (raw), MT-Bench
    first turns (chat) and stdlib function prompts (raw; bench.datasets)."""
    from bench.datasets import humaneval_prompts, mtbench_questions, stdlib_prompts

    every = {"humaneval": lambda: [tokenizer.encode(p) for p in humaneval_prompts(n)],
             "mtbench": lambda: [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
                                 for q in mtbench_questions(n)],
             "stdlib": lambda: [tokenizer.encode(p) for p in stdlib_prompts(n)]}
    return {s: every[s]() for s in sets}


def accept_rate(histogram: list[int], depth: int) -> list[float]:
    """P(accepted drafts ≥ k), k = 1…depth, from histogram[c] = rounds committing c tokens."""
    total = sum(histogram)
    return [round(sum(histogram[k + 1:]) / total, 4) if total else 0.0 for k in range(1, depth + 1)]


def measure(te, de, tok, prompts: list[list[int]], max_new: int, mode: str, budget: int, eos,
            temperature: float = 0.0, seed: int = 0) -> dict:
    """τ over ``prompts``; with ``temperature`` > 0 request i samples with seed ``seed`` + i."""
    taus, hist, t0 = [], [], time.time()
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature, 0, 1.0, seed + i) if temperature else GREEDY
        _, rounds = generate(te, de, tok, p, max_new, mode, budget, eos, f"r{i}", sp)
        taus.append(sum(rounds) / len(rounds))
        for c in rounds:
            hist.extend([0] * (c + 1 - len(hist)))
            hist[c] += 1
    depth = de.cfg.block_size - 1
    return {"tau": round(sum(taus) / len(taus), 3), "tau_per_request": [round(t, 3) for t in taus],
            "histogram": hist, "p_accept_ge": accept_rate(hist, depth), "seconds": round(time.time() - t0, 1)}


def to_markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# DFlash acceptance (τ) — {m['drafter']}", "",
             f"{m['where']}; {_temp(m)}; {m['n']} prompts per set, {m['max_new']} new tokens; "
             f"τ = mean over requests of committed tokens per verify.", "",
             "| set | mode | τ | P(acc≥1) | P(acc≥2) | P(acc≥3) | P(acc≥4) | P(acc≥5) | P(acc≥6) | P(acc≥7) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in res["results"].items():
        s, mode = key.split("/", 1)
        acc = " | ".join(f"{x:.2f}" for x in r["p_accept_ge"][:7])
        lines.append(f"| {s} | {mode} | {r['tau']:.2f} | {acc} |")
    return "\n".join(lines) + "\n"


def comparison(named: dict[str, dict], title: str) -> str:
    """Markdown: τ of several drafters (``named``: {name: a result of ``main``}) side by side,
    one row per set/mode, plus each drafter's P(accepted ≥ k) for k = 1…4."""
    names = list(named)
    first = named[names[0]]
    lines = [f"# {title}", "", f"{first['meta']['where']}; {_temp(first['meta'])}; {first['meta']['n']} prompts per set, "
             f"{first['meta']['max_new']} new tokens; same prompts for every drafter. τ = mean over requests of "
             "committed tokens per verify.", "",
             "| set | mode | " + " | ".join(f"τ {n}" for n in names) + " | " +
             " | ".join(f"P(acc≥1..4) {n}" for n in names) + " |",
             "|---|---|" + "---|" * (2 * len(names))]
    for key in first["results"]:
        s, mode = key.split("/", 1)
        rs = [named[n]["results"].get(key) for n in names]
        taus = " | ".join(f"{r['tau']:.2f}" if r else "–" for r in rs)
        accs = " | ".join(" ".join(f"{x:.2f}" for x in r["p_accept_ge"][:4]) if r else "–" for r in rs)
        lines.append(f"| {s} | {mode} | {taus} | {accs} |")
    return "\n".join(lines) + "\n"


def _temp(meta: dict) -> str:
    t = meta.get("temperature", 0.0)
    return f"T={t:g} (top-k/top-p off, seed {meta.get('seed', 0)}+request)" if t else "T=0 (greedy)"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.acceptance")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--budgets", default="64,4,8,16,32,128,256")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sets", default="humaneval,mtbench", help="comma-separated: humaneval, mtbench, stdlib")
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--out", default="", help="results file stem (default acceptance[-<set>])")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampled (top-k/top-p off)")
    ap.add_argument("--seed", type=int, default=0, help="request i samples with seed SEED+i")
    ap.add_argument("--no-extra-budgets", action="store_true", help="chain + the first budget only")
    ap.add_argument("--table", default="", help="NAME=FILE.json,...: write --out.md/.json comparing those runs")
    a = ap.parse_args(argv)
    from bench.datasets import parse_sets

    try:
        names = parse_sets(a.sets)  # before the engines load
    except ValueError as e:
        ap.error(f"--sets: {e}")
    if a.merge:
        return merge()
    if a.table:
        named = {k: json.loads(pathlib.Path(v).read_text()) for k, v in (x.split("=", 1) for x in a.table.split(","))}
        stem = RESULTS / (a.out or "acceptance_compare")
        stem.with_suffix(".json").write_text(json.dumps(named, indent=1))
        stem.with_suffix(".md").write_text(comparison(named, f"DFlash acceptance (τ): {', '.join(named)}"))
        return print(stem.with_suffix(".md").read_text())
    if a.threads:
        torch.set_num_threads(a.threads)
    budgets = [int(b) for b in a.budgets.split(",")]
    te, de, tok = load_engines(a.drafter, max(budgets))
    sets = prompt_sets(tok, a.n, names)
    out = a.out or ("acceptance" if set(names) == {"humaneval", "mtbench"} else "-".join(("acceptance", *names)))
    if a.no_extra_budgets:
        budgets = budgets[:1]
    eos = tuple(tok.eos_token_ids)
    res = {"meta": {"drafter": str(a.drafter or "checkpoints/dflash-smollm2-135m"), "started": time.time(),
                    "where": f"CPU ({torch.get_num_threads()} threads), fp32, in-process engines",
                    "n": a.n, "max_new": a.max_new, "block_size": de.cfg.block_size,
                    "temperature": a.temperature, "seed": a.seed}, "results": {}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    print("| set | mode | τ | P(acc≥k), k=1… | s |\n|---|---|---|---|---|", flush=True)
    for mode, budget in [("chain", 0)] + [("tree", b) for b in budgets]:  # cheap and headline first
        for name, prompts in sets.items():
            r = measure(te, de, tok, prompts, a.max_new, mode, budget, eos, a.temperature, a.seed)
            key = f"{name}/{mode}" + (f"@{budget}" if mode == "tree" else "")
            res["results"][key] = r
            print(f"| {name} | {key.split('/')[1]} | {r['tau']:.2f} | {r['p_accept_ge']} | {r['seconds']} |", flush=True)
            (RESULTS / f"{out}.json").write_text(json.dumps(res, indent=1))
            (RESULTS / f"{out}.md").write_text(to_markdown(res))
    print(to_markdown(res))


def merge() -> None:
    """Combine acceptance-humaneval.json and acceptance-mtbench.json into acceptance.json/.md."""
    parts = [json.loads((RESULTS / f"acceptance-{s}.json").read_text()) for s in ("humaneval", "mtbench")]
    res = {"meta": parts[0]["meta"], "results": {}}
    keys = [k.split("/", 1)[1] for k in parts[0]["results"]]
    for k in keys:
        for p in parts:
            res["results"].update({key: r for key, r in p["results"].items() if key.endswith("/" + k)})
    (RESULTS / "acceptance.json").write_text(json.dumps(res, indent=1))
    (RESULTS / "acceptance.md").write_text(to_markdown(res))
    print(to_markdown(res))


if __name__ == "__main__":
    main()
