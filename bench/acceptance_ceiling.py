"""The T=1 ceiling of chain τ (issue 9, "T=1 τ ≥ 70 % of T=0"): what a drafter that always
proposes the target's own greedy continuation would reach at T=1, on the bench's prompts.

At T=1 the lossless verify accepts a drafted token with the target's probability of it, so along
a chain every depth multiplies in the target's probability of the proposed token. For a round
whose bonus token sits at response position t, this drafter proposes d_1…d_{B−1}, the target's
greedy continuation, and its expected τ is 1 + Σ_k Π_{j≤k} pmax_j, pmax_j = the target's
probability of d_j after the bonus and d_1…d_{j−1}. At T=0 the same drafter is always accepted
(τ = B). Measured along a T=1 sample of the target (request i draws with seed ``--seed`` + i,
torch.multinomial), every t of the response counted once. Also reported: the mean pmax_1 (chain
depth-1 acceptance bound) and top-4 mass at depth 1 (the bound for a tree that puts 4 children
under the root).

  python3 -m bench.acceptance_ceiling [--n 8] [--max-new 64] [--out bench/results/acceptance_ceiling_t1]
CPU, fp32, one thread: ~5 min for 8 + 8 prompts × 64 tokens (7 one-token forwards per position).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch

from bench.acceptance import RESULTS, prompt_sets


def ceiling(model, prompt: list[int], max_new: int, seed: int, block: int = 8) -> dict:
    """{"tau_oracle", "pmax1", "top4"} means over the response positions of one T=1 sample."""
    from modeling.llama import causal_mask

    def step(cache, ids):  # run ids after the committed rows, commit them, next-token probs
        x = torch.tensor(ids)
        h, _ = model(x, torch.arange(cache.length, cache.length + len(ids)), cache, causal_mask(cache.length, len(ids)))
        cache.length += len(ids)
        return torch.softmax(model.logits(h[-1:]), -1)[0]

    g = torch.Generator().manual_seed(seed)
    cache = model.new_cache(len(prompt) + max_new + block)
    probs, sample = step(cache, prompt), []
    for _ in range(max_new):
        sample.append(int(torch.multinomial(probs, 1, generator=g)))
        probs = step(cache, sample[-1:])
    taus, p1, top4 = [], [], []
    for t in range(max_new - 1, -1, -1):  # backwards: rows < prompt + t stay valid when t shrinks
        cache.length = len(prompt) + t
        x, prod, tau = sample[t], 1.0, 1.0
        for k in range(block - 1):
            probs = step(cache, [x])
            pm, x = float(probs.max()), int(probs.argmax())
            if k == 0:
                p1.append(pm)
                top4.append(float(probs.topk(4).values.sum()))
            prod *= pm
            tau += prod
        taus.append(tau)
    return {"tau_oracle": sum(taus) / len(taus), "pmax1": sum(p1) / len(p1), "top4": sum(top4) / len(top4)}


def main(argv=None) -> None:
    from modeling.llama import LlamaModel
    from modeling.tokenizer import TextTokenizer
    from modeling.weights import default_gguf_path, load_target

    ap = argparse.ArgumentParser(prog="python3 -m bench.acceptance_ceiling")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1000)
    ap.add_argument("--out", default=str(RESULTS / "acceptance_ceiling_t1"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg, state = load_target()
    model = LlamaModel.from_state_dict(cfg, state, "cpu", torch.float32)
    tok = TextTokenizer.from_file(default_gguf_path())
    out = {"meta": {"n": a.n, "max_new": a.max_new, "seed": a.seed, "block": 8, "where": "CPU, fp32, T=1 sample"}}
    with torch.inference_mode():
        for name, prompts in prompt_sets(tok, a.n).items():
            rows = [ceiling(model, p, a.max_new, a.seed + i) for i, p in enumerate(prompts)]
            out[name] = {"per_prompt": [{k: round(v, 3) for k, v in r.items()} for r in rows],
                         **{k: round(sum(r[k] for r in rows) / len(rows), 3) for k in rows[0]}}
            print(name, {k: v for k, v in out[name].items() if k != "per_prompt"}, flush=True)
    pathlib.Path(a.out).with_suffix(".json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
