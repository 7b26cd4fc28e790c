"""Seeded sampling end to end through the real three-process stack on the embedded model.

With the noise keyed by (seed, absolute position), speculative output at temperature > 0 must
equal seeded autoregressive output token for token. The autoregressive reference is computed
in-process with one teacher-forced forward per prompt and the same ``sample`` call plain
decoding makes (token i of the output is drawn at position len(prompt) + i); a few prompts
also run the served autoregressive mode to tie that reference to it. A mismatch is forgiven
only on a numerical near-tie (the uniform within 1e-4 of a CDF boundary), and counted.
"""
import math
import os

import grpc
import pytest
import torch

from conftest import humaneval_prompts, mtbench_questions
from modeling.llama import causal_mask
from modeling.sampling import SamplingParams, position_uniforms, processed_logprobs, sample
from specdec_client import SpecDecError
from specdec_proto.v1 import orchestrator_pb2_grpc

MAX_TOKENS = 64
TEMPERATURE = 0.7
N_PROMPTS = int(os.environ.get("SPECDEC_SAMPLING_E2E_PROMPTS", "50"))  # half code, half chat
PROMPTS = [dict(prompt=p) for p in humaneval_prompts(N_PROMPTS // 2)] + \
          [dict(messages=[{"role": "user", "content": q}]) for q in mtbench_questions(N_PROMPTS - N_PROMPTS // 2)]
SPEC_MODES = [("chain", 0), ("tree", 4)]


def sampling_of(i: int) -> dict:
    """Per-prompt seed; top_p 0.95 on every other prompt."""
    return dict(temperature=TEMPERATURE, seed=1000 + i, top_p=0.95 if i % 2 else 1.0)


def params_of(i: int) -> SamplingParams:
    s = sampling_of(i)  # the wire carries float32, as the servers see it
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))
    return SamplingParams(f32(s["temperature"]), 0, f32(s["top_p"]), s["seed"])


def prompt_ids(tokenizer, p: dict) -> list[int]:
    """The prompt tokens exactly as the orchestrator builds them."""
    if "prompt" in p:
        return tokenizer.encode(p["prompt"])
    return tokenizer.encode(tokenizer.apply_chat_template(p["messages"]))


@torch.inference_mode()
def first_divergence(model, prompt: list[int], out: list[int], params: SamplingParams) -> tuple[int, bool] | None:
    """Check `out` against seeded plain decoding after `prompt` with one teacher-forced
    forward. Returns None if every token matches, else (index, near_tie) of the first
    mismatch; near_tie: the uniform lies within 1e-4 of a CDF boundary there."""
    seq = torch.tensor(prompt + out[:-1])
    cache = model.new_cache(len(seq))
    hidden, _ = model(seq, torch.arange(len(seq)), cache, causal_mask(0, len(seq)))
    logits = model.logits(hidden[len(prompt) - 1:])  # row i predicts output token i
    positions = len(prompt) + torch.arange(len(out))
    want = sample(logits, params, positions)
    bad = (want != torch.tensor(out)).nonzero()
    if bad.numel() == 0:
        return None
    i = int(bad[0])
    cdf = processed_logprobs(logits[i:i + 1], params).exp().cumsum(-1)[0]
    u = float(position_uniforms(params.seed, positions[i:i + 1])[0]) * float(cdf[-1])
    return i, bool(((cdf - u).abs() < 1e-4).any())


@pytest.fixture(scope="module")
def reference_check(target_model, tokenizer):
    def check(i: int, result) -> str | None:
        """None if `result` is seeded plain decoding of prompt i, 'near-tie' if it departs
        only at a numerical near-tie; raises AssertionError otherwise."""
        ids = prompt_ids(tokenizer, PROMPTS[i])
        assert result.prompt_tokens == len(ids)
        out = result.token_ids
        assert out and len(out) <= MAX_TOKENS
        eos = set(tokenizer.eos_token_ids)
        assert not eos & set(out[:-1])  # nothing after an EOS
        assert result.finish_reason == ("stop" if out[-1] in eos else "length")
        assert result.finish_reason == "stop" or len(out) == MAX_TOKENS
        d = first_divergence(target_model, ids, out, params_of(i))
        if d is None:
            return None
        assert d[1], f"prompt {i}: token {d[0]} is not the seeded plain sample (no near-tie)"
        return "near-tie"
    return check


def test_served_autoregressive_equals_reference(client, reference_check):
    half = N_PROMPTS // 2
    for i in (0, 1, half, half + 1):  # text and chat, with and without top_p
        r = client.generate(**PROMPTS[i], max_tokens=MAX_TOKENS, mode="autoregressive", **sampling_of(i))
        assert reference_check(i, r) is None


@pytest.mark.parametrize("mode,budget", SPEC_MODES, ids=[f"{m}{b or ''}" for m, b in SPEC_MODES])
def test_seeded_speculative_equals_seeded_autoregressive(client, reference_check, mode, budget):
    near_ties, accepted, expected = 0, 0.0, 0.0
    for i, p in enumerate(PROMPTS):
        r = client.generate(**p, max_tokens=MAX_TOKENS, mode=mode, tree_budget=budget, **sampling_of(i))
        near_ties += reference_check(i, r) is not None
        hist, st = r.stats.accept_length_histogram, r.stats
        accepted += sum((k - 1) * n for k, n in enumerate(hist) if k)
        expected += st.rounds * (st.expected_accept_length - 1)
    print(f"{mode}{budget or ''}: near-ties {near_ties}, accepted drafts {accepted:.0f}, "
          f"expected {expected:.1f}")
    assert near_ties <= 1
    # calibration: realised accepted drafts against Σ P(path), loosely (≤ 2·16-1 per unit of mean)
    assert abs(accepted - expected) <= 4 * math.sqrt(31 * max(expected, 1.0)) + 2


BAD = [(dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
       (dict(temperature=0.7, top_p=1.5), "top_p"), (dict(temperature=0.7, top_p=-0.1), "top_p"),
       (dict(temperature=0.7, top_k=-1), "top_k")]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f"{f}{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_sampling_params_are_refused(client, kwargs, field):
    with pytest.raises(SpecDecError) as e:
        client.generate(prompt="hi", max_tokens=4, **kwargs)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in e.value.details


@pytest.mark.parametrize("field", ["min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"])
def test_unsupported_sampling_options_are_refused(stack, field):
    """Not in the SDK's arguments, so sent as a raw request: refused, never silently ignored."""
    from specdec_client.client import build_request

    req = build_request("hi", max_tokens=4, temperature=0.7, seed=1)
    setattr(req.sampling, field, 0.5)
    with grpc.insecure_channel(stack.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(orchestrator_pb2_grpc.OrchestratorStub(ch).Generate(req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.{field}" in e.value.details()
