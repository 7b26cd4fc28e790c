"""Lossless end to end: through the real three-process gRPC stack on the embedded model,
speculative greedy output equals plain autoregressive greedy output token for token."""
import pytest

from conftest import humaneval_prompts, mtbench_questions

PROMPTS = [dict(prompt=p) for p in humaneval_prompts(10)] + \
          [dict(messages=[{"role": "user", "content": q}]) for q in mtbench_questions(10)]
SPEC_MODES = [("chain", 0), ("tree", 1), ("tree", 4), ("tree", 16), ("tree", 64)]


@pytest.fixture(scope="module")
def plain(client):
    return [client.generate(**p, max_tokens=64, mode="autoregressive", ignore_eos=True) for p in PROMPTS]


@pytest.mark.parametrize("mode,budget", SPEC_MODES, ids=[f"{m}{b or ''}" for m, b in SPEC_MODES])
def test_speculative_equals_plain(client, plain, mode, budget):
    taus = []
    for p, ref in zip(PROMPTS, plain):
        r = client.generate(**p, max_tokens=64, mode=mode, tree_budget=budget, ignore_eos=True)
        assert r.token_ids == ref.token_ids, (p, mode, budget)
        assert r.text == ref.text and r.finish_reason == ref.finish_reason == "length"
        assert r.completion_tokens == 64
        hist = r.stats.accept_length_histogram
        assert sum(hist) == r.stats.rounds and sum(k * n for k, n in enumerate(hist)) >= 63
        taus.append(r.stats.mean_accept_length)
    print(f"{mode}@{budget}: mean tau {sum(taus) / len(taus):.3f}")


def test_streaming_matches_generate(client, plain):
    chunks = list(client.stream(**PROMPTS[10], max_tokens=64, mode="tree", tree_budget=8, ignore_eos=True))
    result = chunks[-1]
    assert "".join(c.text for c in chunks[:-1]) == result.text == plain[10].text
    assert [t for c in chunks[:-1] for t in c.token_ids] == plain[10].token_ids


def test_eos_ends_output_like_plain(client):
    p = dict(messages=[{"role": "user", "content": "Say hello in one short sentence."}])
    ref = client.generate(**p, max_tokens=200, mode="autoregressive")
    assert ref.finish_reason == "stop" and ref.token_ids[-1] == 2  # <|im_end|>
    for mode, budget in [("chain", 0), ("tree", 16)]:
        r = client.generate(**p, max_tokens=200, mode=mode, tree_budget=budget)
        assert (r.token_ids, r.text, r.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)


def test_async_client(stack, plain):
    import asyncio

    from specdec_client import AsyncSpecDecClient

    async def go():
        async with AsyncSpecDecClient(stack.address) as c:
            return await c.generate(**PROMPTS[0], max_tokens=64, mode="chain", ignore_eos=True)

    assert asyncio.run(go()).token_ids == plain[0].token_ids
