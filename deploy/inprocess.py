"""In-process transport: the orchestrator's own round loop (``orchestrator.generation``)
driving the real engines in this process, without gRPC.

``InProcessTarget`` / ``InProcessDraft`` implement the loop's ``TargetClient`` /
``DraftClient`` protocols by calling ``TargetEngine`` / ``DraftEngine`` directly; engine
errors propagate as the engine raises them. Used by tests (the losslessness matrix) and
benchmarks; the served path uses ``orchestrator.workers`` instead.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass


class InProcessTarget:
    """``TargetClient`` over a ``target_service.engine.TargetEngine``."""

    def __init__(self, engine):
        self.engine = engine

    async def prefill(self, request_id, prompt, max_new_tokens, sampling, mode, tree_budget, timeout=None,
                      hold: bool = False):
        return self.engine.prefill(request_id, prompt, max_new_tokens, sampling, mode.value, tree_budget, hold=hold)

    async def verify(self, request_id, tokens, parents, commit, hold: bool = False):
        return self.engine.verify(request_id, tokens, parents, commit, hold)

    async def release(self, request_id: str, abort: bool = False) -> None:
        self.engine.release([request_id])


class InProcessDraft:
    """``DraftClient`` over a ``draft_service.engine.DraftEngine``; features stay tensors."""

    def __init__(self, engine):
        self.engine = engine
        self.max_context, self.block_size = engine.max_context, engine.cfg.block_size

    async def draft(self, request_id, features, context_start, bonus, mode, tree_budget, timeout=None,
                    round_budget=None):
        kw = {} if round_budget is None else {"round_budget": round_budget}
        return self.engine.draft(request_id, features, context_start, bonus, mode.value, tree_budget, **kw)

    async def release(self, request_id: str, abort: bool = False) -> None:
        self.engine.release([request_id])


@dataclass
class Result:
    """One finished generation: emitted token ids, text, and the loop's ``Finished`` event."""
    token_ids: list[int]
    text: str
    finished: object


async def collect(req, tokenizer, target, draft) -> Result:
    """Run ``orchestrator.generation.generate`` to the end; concatenate its deltas."""
    from orchestrator.generation import generate

    text, ids, final = [], [], None
    async for ev in generate(req, tokenizer, target, draft):
        if hasattr(ev, "token_ids"):
            text.append(ev.text)
            ids += ev.token_ids
        else:
            final = ev
    return Result(ids, "".join(text), final)


def run(req, tokenizer, target, draft) -> Result:
    """Synchronous ``collect``."""
    return asyncio.run(collect(req, tokenizer, target, draft))
