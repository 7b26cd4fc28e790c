"""Worker side of the ``Steps`` stream: many requests' rounds in one message (plans/0009 §2, option B).

A ``Session`` stream costs a worker its per-message Python once per request per round — a woken
thread, a frame read, a parse, a batcher submit, a reply built and sent (75–90 µs on the H200
host) — serially under one GIL; at 64 live requests that is ~5–6 ms per cycle of rounds against a
1–2 ms forward (plans/0009 "Session 21"). On a ``Steps`` stream the orchestrator sends, per step,
one message holding every round its requests are due to run on this worker (each item tagged by
the request's worker id); the handler parses it once, submits its items to the step batcher as
one group (``StepBatcher.submit_many``: they run in one engine call, with whatever other streams
queued meanwhile) and answers with one message, a result or an error per item, in order.

Ownership stays with the request's ``Session``: its first message (the target's open, the
drafter's first draft) goes there, and ending it releases the request. A ``Steps`` stream holds no
request state — ending it (closed, cancelled, failed) frees nothing — and an item whose request
has no open session fails alone (NOT_FOUND / FAILED_PRECONDITION), as does any invalid item.
Items of one stream run one message at a time, in order: the sender's step is self-clocked (it
sends the next message when the previous reply came; ``orchestrator.steps``).
"""
from __future__ import annotations

import time
from typing import Callable, Iterable

import grpc
import structlog

from serving import metrics
from serving.batcher import StepBatcher
from serving.server import status_of

log = structlog.get_logger()


def serve_steps(messages: Iterable, context: grpc.ServicerContext, batcher: StepBatcher,
                decode: Callable, reply: Callable[[list], object], seconds=None):
    """Yield one reply per ``Steps`` message of ``messages``.

    ``decode(item)``: a message item → the batcher's engine item; an exception it raises fails
    that item only (``status_of``: engine errors keep their status). The decoded items of a
    message run as one group (``batcher.submit_many``; skipped when ``context`` is no longer
    active); ``reply(results)`` builds the reply from per-item results, each the engine's result
    or (grpc.StatusCode, details). A non-engine exception from the engine call fails its items
    UNKNOWN (logged once per message), never the stream. ``seconds``: a histogram (the workers'
    ``specdec:worker_op_seconds`` child of the op) observing, per item run, its message's time
    from decode to results — what a Session's message observes — after the reply is out."""
    try:
        for step in messages:
            t = time.perf_counter()
            results: list = [None] * len(step.items)
            work, where = [], []
            for i, item in enumerate(step.items):
                try:
                    work.append(decode(item))
                    where.append(i)
                except Exception as e:  # noqa: BLE001 — that item's error, reported in its result
                    results[i] = status_of(e)
            logged = False
            for i, out in zip(where, batcher.submit_many(work, context.is_active)):
                if isinstance(out, Exception):
                    code, details = status_of(out)
                    if code == grpc.StatusCode.UNKNOWN and not logged:
                        logged = True
                        log.error("steps item failed", error=details)
                    results[i] = code, details
                else:
                    results[i] = out
            if seconds is not None:
                dt = time.perf_counter() - t
                for _ in work:
                    metrics.defer(seconds.observe, dt)
            yield reply(results)
            metrics.flush()  # the reply is out: this step's observations, off its critical path
    finally:
        metrics.flush()
