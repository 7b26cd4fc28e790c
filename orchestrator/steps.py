"""Orchestrator side of the ``Steps`` stream: this process's rounds on one worker, one message a step.

Every request keeps its ``generate`` loop and its ``Session`` with each worker (the open, a
drafter's first draft, the release, the deadline: ownership, ``serving.steps``); its later rounds
— the target's verifies, the drafter's drafts — are handed to the worker's ``StepSender``, which
sends everything queued as one ``Steps`` message and hands each loop its own item's result.

Self-clocked (the workers' batchers' rule, moved to the sender): one message in flight per
worker; rounds that become due while it is out queue and go as the next message as soon as its
reply comes. Requests in lock-step therefore travel together — one message and one reply per
step per worker instead of one per request — and a request never waits more than one step for
a slow one. A loop that stops waiting (cancelled, past its deadline) leaves its item behind:
the worker runs or refuses it (its session gone: NOT_FOUND) and the result is dropped.

A worker's lone request (this process has one session open with it, nothing queued or in flight)
sends its round on its own Session instead (``_Sessions.via_steps``): a step of one item would
only add the sender's task hop to each exchange, the c = 1 case.

Errors: an item's error raises, for that request only, the ``grpc.aio.AioRpcError`` its
Session would have ended with (named by ``_Sessions.named``); a failed stream (the worker gone,
its data socket closed) fails every item in flight and queued, and the next round opens a new
stream. The sender holds no request state, so nothing has to be released with it.
"""
from __future__ import annotations

import asyncio
import contextvars
from typing import Callable

import grpc
import structlog

log = structlog.get_logger()


class StepSender:
    """Rounds of many requests to one worker as ``Steps`` messages.

    Args: ``worker`` (an ``orchestrator.workers._Sessions``: ``open_steps()`` opens the stream,
    ``named(code, details, what)`` builds errors), ``build`` (list of items → the Steps
    message), ``read`` (the reply → per item its result or (grpc.StatusCode, details)),
    ``what`` (what is asked, for errors: "verify", "draft"). ``steps`` / ``items``: messages sent
    and items they carried."""

    def __init__(self, worker, build: Callable[[list], object], read: Callable[[object], list], what: str,
                 max_bytes: int = 64 * 2 ** 20):
        self.worker, self.build, self.read, self.what = worker, build, read, what
        self.limit = max_bytes // 2  # a message, and the reply it asks for, stay under half the worker's limit
        self.reply_item_bytes = 0  # the largest reply bytes per item seen (sizes the next messages' item count)
        self.queue: list[tuple[object, asyncio.Future]] = []
        self.task: asyncio.Task | None = None
        self.call = None
        self.wake: asyncio.Event | None = None
        self.steps = self.items = 0
        self.in_flight = 0  # items of the message out now

    @property
    def busy(self) -> bool:
        """Items queued or in flight: a round submitted now would share a step."""
        return bool(self.queue) or self.in_flight > 0

    async def submit(self, item):
        """Queue ``item`` for the next step and return its result (raises its error)."""
        fut = asyncio.get_running_loop().create_future()
        self.queue.append((item, fut))
        if self.task is None or self.task.done():
            self.wake = asyncio.Event()
            # in a fresh context: the sender serves every request, its log lines carry none's fields
            self.task = contextvars.Context().run(asyncio.ensure_future, self._run())
        self.wake.set()
        return await fut

    async def _run(self) -> None:
        sent: list[asyncio.Future] = []
        try:
            self.call = call = self.worker.open_steps()
            while True:
                while not self.queue:
                    self.wake.clear()
                    await self.wake.wait()
                msg, sent = self._next_message()
                if not sent:
                    continue
                if call.done():  # it ended while idle (a restarted worker, the liveness probe): nothing was lost
                    self.call = call = self.worker.open_steps()
                self.in_flight = len(sent)
                reply = await self.worker.exchange(call, msg, self.what)
                self.reply_item_bytes = max(self.reply_item_bytes, reply.ByteSize() // len(sent))
                results = self.read(reply)
                if len(results) != len(sent):
                    raise self.worker.named(grpc.StatusCode.INTERNAL, f"Steps reply has {len(results)} results for "
                                            f"{len(sent)} items", self.what)
                self.steps += 1
                self.items += len(sent)
                for f, r in zip(sent, results):
                    if f.done():
                        continue
                    if isinstance(r, tuple) and isinstance(r[0], grpc.StatusCode):
                        f.set_exception(self.worker.named(r[0], r[1], self.what))
                    else:
                        f.set_result(r)
                sent, self.in_flight = [], 0
        except asyncio.CancelledError:
            self._fail(sent, self.worker.named(grpc.StatusCode.CANCELLED, "Steps stream closed", self.what))
            raise
        except grpc.aio.AioRpcError as e:  # (named by ``exchange``)
            log.warning("steps stream failed", worker=self.worker.label, error=e.details())
            self._fail(sent, e)
        except Exception as e:  # noqa: BLE001 — a broken stream must not leave loops waiting forever
            log.exception("steps stream failed", worker=self.worker.label)
            self._fail(sent, self.worker.named(grpc.StatusCode.UNAVAILABLE, f"Steps stream: {e}", self.what))
        finally:
            self.in_flight = 0
            if self.call is not None:
                self.call.cancel()
                self.call = None

    def _next_message(self) -> tuple[object, list]:
        """The next message and its items' futures: the queued items still awaited, oldest first,
        as many as keep the message — and its reply, at the largest reply bytes per item seen —
        under ``limit`` (each request's own messages fit the worker's limit; many together need
        not); the rest stay queued for the next message. At least one item."""
        live = [(i, f) for i, f in self.queue if not f.done()]
        n = len(live) if not self.reply_item_bytes else max(1, min(len(live), self.limit // self.reply_item_bytes))
        while True:
            msg = self.build([i for i, _ in live[:n]])
            if n == 1 or msg.ByteSize() <= self.limit:
                break
            n //= 2
        self.queue = live[n:]
        return msg, [f for _, f in live[:n]]

    def _fail(self, sent: list, err: Exception) -> None:
        """``err`` for every item in flight and queued (the stream is gone; the next submit opens one)."""
        queued, self.queue = [f for _, f in self.queue], []
        for f in sent + queued:
            if not f.done():
                f.set_exception(err)
