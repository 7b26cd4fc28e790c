"""The round loop sends the next round's draft before it pushes and streams the current round's
tokens (plans/0004 "Session 6: where the data-channel round goes"). On the real target engine
with a drafter that proposes the true continuation: a stop token id or max_tokens inside a step
is seen before drafting (no wasted draft); a stop string found while pushing wastes exactly one
draft, which is never emitted, finishes before the drafter's session is released (gracefully);
a consumer that leaves while a draft is in flight cancels it and aborts both sessions."""
import asyncio

from deploy.inprocess import InProcessTarget
from orchestrator.generation import GenerationRequest, generate
from test_generation_loop import collect, setup  # noqa: F401  (the real target engine, the plain greedy reference)


class CountingDrafter:
    """DraftClient proposing the known greedy continuation as a chain of ``k`` tokens; records
    every draft call (started / finished / cancelled) and every release, in order."""

    max_context, block_size = 1 << 20, 16

    def __init__(self, prompt_len, continuation, k=6, delay=0.0):
        self.prompt_len, self.cont, self.k, self.delay = prompt_len, continuation, k, delay
        self.events: list[tuple] = []

    async def draft(self, rid, features, context_start, bonus, mode, budget, timeout=None):
        self.events.append(("draft", rid))
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.events.append(("cancelled", rid))
            raise
        emitted = context_start + features.shape[0] - self.prompt_len + 1
        tokens, parents = [bonus], [-1]
        for t in self.cont[emitted:emitted + self.k]:
            tokens.append(t)
            parents.append(len(tokens) - 2)
        self.events.append(("drafted", rid))
        return tokens, parents

    async def release(self, rid, abort=False):
        self.events.append(("release", rid, abort))

    def count(self, kind: str) -> int:
        return sum(e[0] == kind for e in self.events)


def run(setup, tokenizer, **kw):  # noqa: F811
    engine, prompt, (_, plain_ids, _) = setup
    drafter = CountingDrafter(len(prompt), plain_ids)
    req = GenerationRequest("spec", prompt, kw.pop("max_tokens", 48), mode="tree", **kw)
    return (*asyncio.run(collect(req, tokenizer, InProcessTarget(engine), drafter)), drafter)


def test_stop_token_and_length_waste_no_draft(setup, tokenizer):  # noqa: F811
    engine, _, (_, plain_ids, _) = setup
    for kw in ({"stop_token_ids": {plain_ids[9]}}, {"max_tokens": 11}):
        text, ids, final, d = run(setup, tokenizer, **kw)
        assert ids == plain_ids[:len(ids)] and len(ids) <= 11
        assert d.count("draft") == final.stats.rounds  # each draft was verified; none wasted
        assert sum(k * n for k, n in enumerate(final.stats.histogram)) == len(ids) - 1  # (+ the prefill's token)
        assert d.events[-1][0] == "release" and d.events[-1][2] is False
    assert engine.live_requests == 0


def run_to_mid_round_stop(setup, tokenizer):
    """``run`` with a stop string spanning two tokens in the middle of a round; checks that the
    output is the plain greedy output cut at the stop; returns (token ids, final, drafter)."""
    _, _, (plain_text, plain_ids, _) = setup
    a, b = tokenizer.decode(plain_ids[:15]), tokenizer.decode(plain_ids[:17])
    stop = b[len(a) - 2:]
    text, ids, final, d = run(setup, tokenizer, stop=[stop])
    n = next(k for k in range(1, len(plain_ids) + 1) if stop in tokenizer.decode(plain_ids[:k]))
    assert final.finish_reason == "stop" and text == plain_text[:plain_text.find(stop)] and ids == plain_ids[:n]
    return ids, final, d


def test_stop_string_wastes_one_draft_never_emitted(setup, tokenizer):  # noqa: F811
    engine = setup[0]
    ids, final, d = run_to_mid_round_stop(setup, tokenizer)
    assert d.count("draft") == final.stats.rounds + 1 and d.count("drafted") == d.count("draft")
    # τ counts only emitted tokens; the wasted draft finished before its session was released, gracefully
    assert sum(k * n for k, n in enumerate(final.stats.histogram)) == len(ids) - 1
    assert d.events[-2][0] == "drafted" and d.events[-1] == ("release", d.events[-1][1], False)
    assert engine.live_requests == 0


def test_leaving_with_a_draft_in_flight_cancels_it(setup, tokenizer):  # noqa: F811
    engine, prompt, (_, plain_ids, _) = setup
    d = CountingDrafter(len(prompt), plain_ids, delay=30.0)  # a draft that would not return in the test's time

    async def leave_after_first_delta():
        gen = generate(GenerationRequest("spec", prompt, 48, mode="tree"), tokenizer, InProcessTarget(engine), d)
        first = await gen.__anext__()  # the prefill's token; the first draft is on its way
        assert first.token_ids == plain_ids[:1] and d.count("draft") == 1
        await asyncio.wait_for(gen.aclose(), 5)  # the consumer leaves (a client cancel)

    asyncio.run(leave_after_first_delta())
    assert d.count("cancelled") == 1 and d.count("drafted") == 0
    assert d.events[-1][0] == "release" and d.events[-1][2] is True  # aborted
    assert engine.live_requests == 0
