"""The orchestrator's round loop on the real target engine with a drafter that proposes the
true continuation (so every round accepts several tokens): stops falling inside a multi-token
step end the output exactly where plain decoding does."""
import asyncio

import pytest
import torch

from modeling.sampling import SamplingParams
from orchestrator.generation import GenerationRequest, generate
from deploy.inprocess import InProcessTarget
from target_service.engine import TargetEngine

PROMPT = "Write a short story about a robot who learns to paint."


class ContinuationDrafter:
    """DraftClient proposing the known greedy continuation as a chain of ``k`` tokens, plus a
    wrong sibling at each depth (so it is a real tree)."""

    max_context, block_size = 1 << 20, 16

    def __init__(self, prompt_len, continuation, k):
        self.prompt_len, self.cont, self.k = prompt_len, continuation, k

    async def draft(self, rid, features, context_start, bonus, mode, budget, timeout=None):
        emitted = context_start + features.shape[0] - self.prompt_len + 1  # tokens emitted so far
        nxt = self.cont[emitted:emitted + self.k]
        tokens, parents = [bonus], [-1]
        for t in nxt:
            parent = len(tokens) - 1 if len(tokens) == 1 else len(tokens) - 2
            tokens += [t, (t + 1) % 49152]
            parents += [parent, parent]
        return tokens, parents

    async def release(self, rid, abort=False):
        pass


@pytest.fixture(scope="module")
def setup(target_model, tokenizer):
    engine = TargetEngine(target_model, (1, 14, 27), max_context=2048, kv_pool_tokens=1 << 15)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    plain = asyncio.run(collect(GenerationRequest("plain", prompt, 48, mode="autoregressive"),
                                tokenizer, InProcessTarget(engine), None))
    return engine, prompt, plain


async def collect(req, tokenizer, target, draft):
    text, ids, final = "", [], None
    async for ev in generate(req, tokenizer, target, draft):
        if hasattr(ev, "text"):
            text += ev.text
            ids += ev.token_ids
        else:
            final = ev
    return text, ids, final


def spec(setup, tokenizer, **kw):
    engine, prompt, (_, plain_ids, _) = setup
    req = GenerationRequest("spec", prompt, kw.pop("max_tokens", 48), mode="tree", **kw)
    drafter = ContinuationDrafter(len(prompt), plain_ids, k=6)
    return asyncio.run(collect(req, tokenizer, InProcessTarget(engine), drafter))


def test_full_acceptance_matches_plain(setup, tokenizer):
    _, _, (plain_text, plain_ids, _) = setup
    text, ids, final = spec(setup, tokenizer)
    assert ids == plain_ids and text == plain_text
    assert final.stats.mean_accept_length > 5  # several tokens per round


def test_stop_token_inside_step(setup, tokenizer):
    _, _, (_, plain_ids, _) = setup
    j = 9  # stop at the 10th token: inside the second round's accepted path
    stop_tok = plain_ids[j]
    first = plain_ids.index(stop_tok)
    text, ids, final = spec(setup, tokenizer, stop_token_ids={stop_tok})
    assert ids == plain_ids[:first + 1] and final.finish_reason == "stop"
    assert text == tokenizer.decode(plain_ids[:first])


def test_stop_string_inside_step(setup, tokenizer):
    _, _, (plain_text, plain_ids, _) = setup
    # A stop string spanning two tokens in the middle of a round.
    a, b = tokenizer.decode(plain_ids[:15]), tokenizer.decode(plain_ids[:17])
    stop = b[len(a) - 2:]
    cut = plain_text.find(stop)
    text, ids, final = spec(setup, tokenizer, stop=[stop])
    assert final.finish_reason == "stop" and text == plain_text[:cut]
    n = next(k for k in range(1, len(plain_ids) + 1) if stop in tokenizer.decode(plain_ids[:k]))
    assert ids == plain_ids[:n]


def test_max_tokens_inside_step(setup, tokenizer):
    _, _, (_, plain_ids, _) = setup
    text, ids, final = spec(setup, tokenizer, max_tokens=11)
    assert ids == plain_ids[:11] and final.finish_reason == "length"
    assert final.completion_tokens == 11 and text == tokenizer.decode(plain_ids[:11])


def test_requests_released(setup):
    engine = setup[0]
    assert engine.live_requests == 0
