"""The round loop's draft overlap (the next round's draft goes out before the current round's
tokens are pushed and streamed) over the real workers' data channel: a stop string found while
pushing wastes one draft that is never emitted — the text is the unstopped text cut at the stop —
and both workers free the request (the drafter's session ends after the wasted draft)."""
from __future__ import annotations

import asyncio

from orchestrator.generation import Finished, GenerationRequest, generate
from test_datachannel import workers  # noqa: F401  (the module's real workers with data channels)


async def _text(w, tok, prompt, stop=()):
    target, draft = w.clients("socket")
    await target.info()
    await draft.info()
    req = GenerationRequest("overlap", prompt, 24, mode="tree", tree_budget=16, stop=list(stop))
    text, ids, fin = "", [], None
    async for ev in generate(req, tok, target, draft):
        if isinstance(ev, Finished):
            fin = ev
        else:
            text, ids = text + ev.text, ids + ev.token_ids
    return text, ids, fin


def test_a_stop_string_with_a_draft_in_flight_emits_nothing_past_it(workers, tokenizer):  # noqa: F811
    prompt = tokenizer.encode("def fibonacci(n):")
    full, full_ids, _ = asyncio.run(_text(workers, tokenizer, prompt))
    at = next(i for i in range(len(full) // 2, len(full) - 3) if full[i:i + 3].strip() == full[i:i + 3])
    stop = full[at:at + 3]  # three visible characters from the second half
    text, ids, fin = asyncio.run(_text(workers, tokenizer, prompt, [stop]))
    assert fin.finish_reason == "stop" and text == full[:full.find(stop)] and ids == full_ids[:len(ids)]
    assert sum(k * n for k, n in enumerate(fin.stats.histogram)) == len(ids) - 1  # τ: emitted tokens only
    assert workers.wait_idle() == (0, 0)
