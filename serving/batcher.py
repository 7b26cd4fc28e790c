"""Worker-side step batcher: many Session streams, one engine call per step (issue 14).

Each worker RPC handler thread ``submit``\\s one item (a verify or draft message, already
decoded) and blocks until its own result comes back. One engine thread takes whatever is queued
— at most ``max_batch`` items — and runs ``run_batch(items)`` once, which returns one result or
exception per item, in order. Items that arrive while a batch runs wait and form the next
batch, so the batch size follows the load by itself (self-clocking): one request alone runs as
before, n requests in lock-step rounds run as batches of up to n.

This is iteration-level scheduling as Orca (Yu et al., OSDI 2022) describes it and vLLM's
engine loop runs it: a request joins the batch at its next step and leaves it when it stops,
between engine calls, never waiting for a whole "batch of requests" to finish. Here the steps
are the requests' own rounds (each request keeps its ``generate`` loop and its streams), so
nothing outside the worker changes.

Rules:
- an item whose caller is gone (``alive()`` False: its RPC was cancelled or passed its
  deadline) when its batch forms is dropped with ``Skipped`` — no engine work for a dead request;
- an exception raised by ``run_batch`` fails every item of that batch with it; the engine thread
  goes on with the next batch;
- ``close()`` refuses new items with ``Closed``, fails the queued ones with ``Closed`` (or,
  ``drain=True``, runs them first) and lets the running batch finish.

``wait_s`` (default 0; the workers' ``--batch-wait-us``) holds a batch that is not full for up
to that long so stragglers can join (a trade of latency for batch size when messages trickle in
over longer than an engine call takes); 0 takes what is there.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence


class Skipped(Exception):
    """The item's caller was gone before its batch ran; the engine never saw it."""


class Closed(Exception):
    """The batcher is shut down (the server is stopping): the item was not run."""


class _Entry:
    __slots__ = ("item", "alive", "future")

    def __init__(self, item, alive):
        self.item, self.alive, self.future = item, alive, Future()


class StepBatcher:
    """Gathers items from many threads into batches for ``run_batch`` on one engine thread.

    Args: run_batch (list of items → list of result | Exception, same length and order; may
    raise), max_batch (most items per call, ≥ 1; an attribute, read as each batch forms),
    wait_s (seconds a batch that is not full waits for more items, default 0), name (the
    thread's), on_batch (called with each batch's size after it ran, e.g. a histogram's
    ``observe``).
    """

    def __init__(self, run_batch: Callable[[list], Sequence], max_batch: int = 64, wait_s: float = 0.0,
                 name: str = "batcher", on_batch: Callable[[int], None] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.run_batch, self.max_batch, self.wait_s, self.on_batch = run_batch, max_batch, wait_s, on_batch
        self._queue: collections.deque[_Entry] = collections.deque()
        self._cond = threading.Condition()
        self._closed = self._drain = False
        self.batches = 0  # engine calls made (each with ≥ 1 item)
        self.items = 0    # items run through those calls
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Items waiting for a batch (not counting the one running)."""
        with self._cond:
            return len(self._queue)

    def submit(self, item, alive: Callable[[], bool] | None = None):
        """Queue ``item``, wait for its batch, return its result or raise its exception
        (``Skipped`` when ``alive()`` was False as its batch formed, ``Closed`` after ``close``)."""
        entry = _Entry(item, alive)
        with self._cond:
            if self._closed:
                raise Closed("the server is shutting down")
            self._queue.append(entry)
            self._cond.notify()
        return entry.future.result()

    def close(self, drain: bool = False, timeout: float | None = None) -> None:
        """Refuse new items; fail the queued ones with ``Closed`` (``drain``: run them first);
        wait up to ``timeout`` seconds (None: forever, 0: not at all) for the engine thread."""
        with self._cond:
            self._closed, self._drain = True, drain
            if not drain:
                while self._queue:
                    self._queue.popleft().future.set_exception(Closed("the server is shutting down"))
            self._cond.notify()
        if timeout != 0:
            self._thread.join(timeout)

    def _next(self) -> list[_Entry] | None:
        """The next batch (None: closed and nothing left to run)."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None
            if self.wait_s > 0 and len(self._queue) < self.max_batch and not self._closed:
                end = time.monotonic() + self.wait_s
                while len(self._queue) < self.max_batch and not self._closed and (left := end - time.monotonic()) > 0:
                    self._cond.wait(left)
            return [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]

    def _loop(self) -> None:
        while (batch := self._next()) is not None:
            live = []
            for e in batch:
                try:
                    gone = e.alive is not None and not e.alive()
                except Exception:  # a broken liveness check must not end the engine thread
                    gone = False
                if gone:
                    e.future.set_exception(Skipped("the request ended before its batch ran"))
                else:
                    live.append(e)
            if not live:
                continue
            try:
                results = list(self.run_batch([e.item for e in live]))
                if len(results) != len(live):
                    raise RuntimeError(f"run_batch returned {len(results)} results for {len(live)} items")
            except Exception as err:  # the whole batch failed: each of its items gets the error
                results = [err] * len(live)
            for e, r in zip(live, results):
                if isinstance(r, BaseException):
                    e.future.set_exception(r)
                else:
                    e.future.set_result(r)
            self.batches += 1
            self.items += len(live)
            if self.on_batch is not None:
                try:
                    self.on_batch(len(live))
                except Exception:
                    pass
