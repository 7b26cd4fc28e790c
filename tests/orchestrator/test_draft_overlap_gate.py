"""The draft overlap's gate (``generation.OVERLAP_MAX_LIVE``): with more live requests than it
allows, the round loop drafts after the round's tokens went out, as before the overlap — same
output as plain greedy, and a stop string wastes no draft (each draft was verified); the
first delta goes out before any draft was asked for."""
import asyncio

from deploy.inprocess import InProcessTarget
from orchestrator import generation
from orchestrator.generation import GenerationRequest, generate
from test_draft_overlap import CountingDrafter, run_to_mid_round_stop
from test_generation_loop import setup  # noqa: F401  (the real target engine, the plain greedy reference)


def test_gated_off_drafts_after_emission(setup, tokenizer, monkeypatch):  # noqa: F811
    monkeypatch.setattr(generation, "OVERLAP_MAX_LIVE", 0)  # one live request is already more
    engine, prompt, (_, plain_ids, _) = setup
    _, final, d = run_to_mid_round_stop(setup, tokenizer)
    assert d.count("draft") == final.stats.rounds  # none wasted: the stop was seen before drafting
    assert d.events[-1] == ("release", d.events[-1][1], False)

    d = CountingDrafter(len(prompt), plain_ids)

    async def first_delta():
        gen = generate(GenerationRequest("spec", prompt, 48, mode="tree"), tokenizer, InProcessTarget(engine), d)
        first = await gen.__anext__()
        assert first.token_ids == plain_ids[:1] and d.count("draft") == 0  # (the overlap would have sent one)
        await gen.aclose()

    asyncio.run(first_delta())
    assert engine.live_requests == 0
