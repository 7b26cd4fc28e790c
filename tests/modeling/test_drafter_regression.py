"""The shipped DFlash drafter (checkpoints/dflash-smollm2-135m) keeps its acceptance on fixed
held-out prompts, and speculative greedy output stays identical to plain greedy decoding.

In-process engines, fp32 on CPU, T=0, 40 new tokens, one thread. Floors = τ measured when the
checkpoint was shipped (see its README.md) minus a margin."""
from __future__ import annotations

import pytest
import torch

from deploy.inprocess import run
from modeling.defaults import DEFAULT_DRAFTER_DIR
from modeling.llama import causal_mask
from bench.datasets import humaneval_prompts, mtbench_questions
from orchestrator.generation import GenerationRequest

MAX_NEW = 40
# τ measured on these 5 prompts at shipping time (session 5's drafter): chain 2.151, tree@16 2.670
# (per prompt chain [2.44, 1.22, 3.00, 1.50, 2.60], tree [3.00, 1.50, 3.55, 2.05, 3.25]); the floors
# leave ~0.15 / ~0.09 for near-tie numerics on other CPUs. The previous drafter (session 4: chain
# 1.901, tree@16 2.547; session 1: 1.560, 1.988) is below both, so a revert to it fails here.
FLOORS = {"chain": 2.00, "tree": 2.58}


@pytest.fixture(scope="module")
def clients(inprocess):
    if not (DEFAULT_DRAFTER_DIR / "config.json").exists():
        pytest.skip("no shipped drafter")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small per-round work: one thread is faster and immune to oversubscription
    yield inprocess
    torch.set_num_threads(threads)


def generate(clients, tokenizer, prompt, max_new, mode, budget=1):
    """The orchestrator's round loop in process, greedy, no stop tokens: (tokens, τ)."""
    req = GenerationRequest("reg", prompt, max_new, mode=mode, tree_budget=budget)
    r = run(req, tokenizer, clients[0], clients[1] if mode != "autoregressive" else None)
    return r.token_ids, r.finished.stats.mean_accept_length


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chat = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
            for q in mtbench_questions(2)]
    return [tokenizer.encode(p) for p in humaneval_prompts(3)] + chat


def plain_greedy_agrees(model, prompt: list[int], out: list[int]) -> bool:
    """One causal forward over prompt + out: every generated token is the argmax after its prefix."""
    seq = torch.tensor(prompt + out)
    hidden, _ = model(seq, torch.arange(len(seq)), model.new_cache(len(seq)), causal_mask(0, len(seq)))
    pred = model.logits(hidden[len(prompt) - 1:-1]).argmax(-1)
    return pred.tolist() == out


@pytest.mark.parametrize("mode,budget", [pytest.param("chain", 0, marks=pytest.mark.slow), ("tree", 16)])  # chain: slow tier (CI time)
def test_acceptance_floor_and_greedy_identity(clients, tokenizer, prompts, target_model, mode, budget):
    taus = []
    for i, p in enumerate(prompts):
        out, tau = generate(clients, tokenizer, p, MAX_NEW, mode, budget or 1)
        assert len(out) == MAX_NEW
        assert plain_greedy_agrees(target_model, p, out), f"prompt {i}: speculative greedy != plain greedy"
        taus.append(tau)
    tau = sum(taus) / len(taus)
    print(f"{mode}@{budget}: tau {tau:.3f} per prompt {[round(t, 2) for t in taus]}")
    assert tau >= FLOORS[mode], f"{mode} tau {tau:.3f} fell below the floor {FLOORS[mode]}"
