"""The losslessness matrix, in process: the orchestrator's own round loop
(``orchestrator.generation.generate``) drives the real target and draft engines (embedded
SmolLM2-135M, the shipped DFlash drafter) through the in-process transport, no gRPC.

Greedy: every output token of every mode is the target's argmax after the output's own
prefix, checked with one teacher-forced forward over prompt + output (what plain greedy
decoding computes token by token). Seeded sampling: every token is the seeded plain sample at
its absolute position. A mismatch is forgiven only at a numerical near-tie, and counted.

Fast tier (CI): a few prompts per mode. ``pytest -m slow``: the full matrix (20 prompts × 64
tokens × every mode greedy; 50 prompts × 2 modes seeded, with acceptance calibration).
"""
import math

import pytest

from bench.datasets import humaneval_prompts, mtbench_questions
from deploy.inprocess import run
from modeling.sampling import SamplingParams
from orchestrator.generation import GenerationRequest
from lossless_reference import greedy_divergences, sampled_divergences

GREEDY_MODES = [("autoregressive", 0), ("chain", 0), ("tree", 1), ("tree", 4), ("tree", 16), ("tree", 64)]
SAMPLED_MODES = [("chain", 0), ("tree", 4)]
MODE_IDS = lambda modes: [f"{m}{b or ''}" for m, b in modes]
# the fast tier keeps one mode of each kind (CI time, README); every mode runs in the slow tier's _full tests
FAST_GREEDY = [("autoregressive", 0), ("chain", 0), ("tree", 16)]
FAST_SAMPLED = [("tree", 4)]


def prompt_set(tokenizer, n_code: int, n_chat: int) -> list[list[int]]:
    """HumanEval prompts raw, MT-Bench questions through the chat template (as the
    orchestrator tokenizes them)."""
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in mtbench_questions(n_chat)]
    return [tokenizer.encode(t) for t in humaneval_prompts(n_code) + chat]


def generate(inprocess, tokenizer, prompt, max_tokens, mode, budget, sampling=SamplingParams(), stop_ids=()):
    target, draft = inprocess
    req = GenerationRequest("lossless", prompt, max_tokens, mode=mode, tree_budget=budget or 1,
                            stop_token_ids=set(stop_ids), sampling=sampling)
    return run(req, tokenizer, target, draft if mode != "autoregressive" else None)


def check_greedy_matrix(inprocess, tokenizer, model, prompts, max_tokens, mode, budget):
    """Every prompt's output in `mode` is plain greedy decoding; returns the near-tie count."""
    ties, taus = 0, []
    for i, p in enumerate(prompts):
        r = generate(inprocess, tokenizer, p, max_tokens, mode, budget)
        f = r.finished
        assert r.token_ids and len(r.token_ids) == f.completion_tokens == max_tokens
        assert f.finish_reason == "length" and f.prompt_tokens == len(p)
        assert r.text == tokenizer.decode(r.token_ids)
        bad, t = greedy_divergences(model, p, r.token_ids)
        assert bad is None, f"prompt {i}, {mode}@{budget}: token {bad} is not plain greedy"
        ties += t
        hist = f.stats.histogram
        assert sum(hist) == f.stats.rounds and sum(k * n for k, n in enumerate(hist)) >= max_tokens - 1
        taus.append(f.stats.mean_accept_length)
    print(f"{mode}@{budget}: mean tau {sum(taus) / len(taus):.3f}, near-ties {ties}")
    return ties


@pytest.mark.parametrize("mode,budget", FAST_GREEDY, ids=MODE_IDS(FAST_GREEDY))
def test_greedy_equals_plain(inprocess, tokenizer, target_model, mode, budget):
    prompts = prompt_set(tokenizer, 2, 1)
    assert check_greedy_matrix(inprocess, tokenizer, target_model, prompts, 24, mode, budget) <= 1


@pytest.mark.slow
@pytest.mark.parametrize("mode,budget", GREEDY_MODES, ids=MODE_IDS(GREEDY_MODES))
def test_greedy_equals_plain_full(inprocess, tokenizer, target_model, mode, budget):
    prompts = prompt_set(tokenizer, 10, 10)
    assert check_greedy_matrix(inprocess, tokenizer, target_model, prompts, 64, mode, budget) <= 1


def test_eos_ends_output_like_plain(inprocess, tokenizer):
    """Without ignore_eos the output ends at the EOS inside an accepted path, as plain decoding
    does: same ids, same text, finish 'stop'."""
    p = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Say hello in one short sentence."}]))
    eos = tokenizer.eos_token_ids
    ref = generate(inprocess, tokenizer, p, 200, "autoregressive", 0, stop_ids=eos)
    assert ref.finished.finish_reason == "stop" and ref.token_ids[-1] in eos
    for mode, budget in [("chain", 0), ("tree", 16)]:
        r = generate(inprocess, tokenizer, p, 200, mode, budget, stop_ids=eos)
        assert (r.token_ids, r.text, r.finished.finish_reason) == (ref.token_ids, ref.text, "stop")


def sampling_of(i: int) -> SamplingParams:
    """Per-prompt seed; top_p 0.95 on every other prompt."""
    return SamplingParams(0.7, 0, 0.95 if i % 2 else 1.0, 1000 + i)


def check_sampled_matrix(inprocess, tokenizer, model, prompts, max_tokens, mode, budget):
    """Seeded output of every prompt is seeded plain sampling; returns (near-ties, accepted
    drafts, expected accepted drafts Σ P(path))."""
    eos = set(tokenizer.eos_token_ids)
    ties, accepted, expected = 0, 0, 0.0
    for i, p in enumerate(prompts):
        r = generate(inprocess, tokenizer, p, max_tokens, mode, budget, sampling_of(i), eos)
        out, f = r.token_ids, r.finished
        assert out and len(out) <= max_tokens and not eos & set(out[:-1])
        assert f.finish_reason == ("stop" if out[-1] in eos else "length")
        bad, t = sampled_divergences(model, p, out, sampling_of(i))
        assert bad is None, f"prompt {i}, {mode}@{budget}: token {bad} is not the seeded plain sample"
        ties += t
        accepted += sum((k - 1) * n for k, n in enumerate(f.stats.histogram) if k)
        expected += f.stats.expected_accepted
    print(f"{mode}@{budget}: near-ties {ties}, accepted drafts {accepted}, expected {expected:.1f}")
    return ties, accepted, expected


def test_seeded_autoregressive_is_plain_sampling(inprocess, tokenizer, target_model):
    prompts = prompt_set(tokenizer, 1, 1)
    assert check_sampled_matrix(inprocess, tokenizer, target_model, prompts, 24, "autoregressive", 0)[0] == 0


@pytest.mark.parametrize("mode,budget", FAST_SAMPLED, ids=MODE_IDS(FAST_SAMPLED))
def test_seeded_speculative_equals_seeded_plain(inprocess, tokenizer, target_model, mode, budget):
    prompts = prompt_set(tokenizer, 2, 2)
    assert check_sampled_matrix(inprocess, tokenizer, target_model, prompts, 24, mode, budget)[0] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("mode,budget", SAMPLED_MODES, ids=MODE_IDS(SAMPLED_MODES))
def test_seeded_speculative_equals_seeded_plain_full(inprocess, tokenizer, target_model, mode, budget):
    prompts = prompt_set(tokenizer, 25, 25)
    ties, accepted, expected = check_sampled_matrix(inprocess, tokenizer, target_model, prompts, 64, mode, budget)
    assert ties <= 1
    # calibration: realised accepted drafts against Σ P(path), loosely (≤ 2·16-1 per unit of mean)
    assert abs(accepted - expected) <= 4 * math.sqrt(31 * max(expected, 1.0)) + 2


def test_prompt_near_the_drafters_context_end_falls_back_to_one_token_rounds(engines, tokenizer, target_model):
    """A prompt whose length + draft block passes the drafter's context (an 8185-token prompt
    on the 8192-position drafter, here scaled down to a 64-position drafter) is served: rounds
    draft while the block fits, then verify one token at a time; output = plain greedy."""
    from deploy.inprocess import InProcessDraft, InProcessTarget
    from draft_service.engine import DraftEngine

    te, de = engines
    small = DraftEngine(de.drafter, de.embed, de.lm_head, max_tree_budget=16, max_context=64)
    prompt = tokenizer.encode(humaneval_prompts(1)[0])[:40]
    for n_prompt, max_tokens in [(40, 20), (60, 4)]:  # 40: drafts, then falls back; 60: never drafts
        p = (prompt * 2)[:n_prompt]
        for mode in ("chain", "tree"):
            req = GenerationRequest("edge", p, max_tokens, mode=mode, tree_budget=8)
            r = run(req, tokenizer, InProcessTarget(te), InProcessDraft(small))
            assert len(r.token_ids) == max_tokens and r.finished.finish_reason == "length"
            assert greedy_divergences(target_model, p, r.token_ids)[0] is None
            assert small.live_requests == 0 and te.live_requests == 0
            rounds = r.finished.stats.histogram
            assert sum(rounds) == r.finished.stats.rounds
            if n_prompt == 60:
                assert r.finished.stats.draft_seconds == 0 and rounds[1:] == [max_tokens - 1]
