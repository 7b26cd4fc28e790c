"""The draft service's health as the round loop sees it, shared by every request of the process.

The drafter only proposes; the target alone decides every token. So when the draft service is
unreachable, fails or misses the per-round deadline, a request loses nothing by going on with
one-token rounds (the tree is the pending bonus token alone, verified by the same target path):
greedy output and seeded samples are those it would have produced anyway. ``DraftHealth`` is
the circuit breaker that makes this one decision for all requests:

- the first failure of an outage turns it *down* and logs one warning (later failures of the
  same outage, from other requests, log nothing);
- while down no request talks to the drafter; once ``retry_at`` has passed, one probe
  (grpc.health.v1 readiness of the draft service) runs for all of them, the next after a
  backoff that doubles up to ``max_backoff`` — no storm of reconnects (the orchestrator's
  readiness follower also runs the due probe when the draft service's health check passes:
  ``check_now``);
- a successful probe turns it *up* again (one info line) and requests open new draft sessions
  (``orchestrator.features`` says what context they get); the backoff resets after the next
  successful draft, so a drafter that answers probes but fails every draft is retried ever
  less often.

Failures are tagged with the ``epoch`` they were seen in, so a request's stale session failing
after a recovery does not start a new outage.
"""
from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Awaitable, Callable

import structlog
import structlog.contextvars

log = structlog.get_logger()


async def _always_ready() -> bool:
    return True


def _spawn(coro) -> asyncio.Task:
    """A task for the shared probe whose log lines are the process's, not those of the request
    that happened to start it (no ``request_id``/``worker_id`` in its context)."""
    ctx = contextvars.copy_context()
    ctx.run(structlog.contextvars.unbind_contextvars, "request_id", "worker_id")
    return ctx.run(asyncio.get_running_loop().create_task, coro)


class DraftHealth:
    """probe(): async, True when the draft service is ready (default: always, for in-process
    drafters). round_timeout: seconds one draft call may take before the round falls back
    (None: no limit). replay_rows: feature rows each request keeps for a new draft session
    (``orchestrator.features``). Backoffs in seconds."""

    def __init__(self, probe: Callable[[], Awaitable[bool]] = _always_ready, round_timeout: float | None = None,
                 replay_rows: int = 256, min_backoff: float = 0.5, max_backoff: float = 2.0):
        self.probe, self.min_backoff, self.max_backoff = probe, min_backoff, max_backoff
        self.round_timeout, self.replay_rows = round_timeout, replay_rows
        self.up, self.epoch = True, 0
        self.backoff, self.retry_at, self.down_since = min_backoff, 0.0, 0.0
        self.outages = 0
        self._probing: asyncio.Task | None = None

    async def usable(self) -> bool:
        """True when requests may draft. While down, starts the shared probe when one is due;
        the caller does not wait for it (a probe that answers at once counts this round)."""
        if self.up:
            return True
        if time.monotonic() >= self.retry_at and (self._probing is None or self._probing.done()):
            self._probing = _spawn(self._check())
            await asyncio.sleep(0)  # let it start
        return self.up

    async def check_now(self) -> None:
        """Probe now if one is due (the orchestrator's readiness follower calls it when the draft
        service's health check passes during an outage, so the outage ends without waiting for
        a request to probe): ends the outage when the probe passes. Keeps the backoff (a drafter
        that answers health checks but fails its drafts is not retried more often) and waits
        for a probe already running instead of starting a second."""
        if self.up or time.monotonic() < self.retry_at:
            return
        if self._probing is None or self._probing.done():
            self._probing = _spawn(self._check())
        await asyncio.shield(self._probing)

    def failed(self, epoch: int, error: str) -> None:
        """A draft call seen in ``epoch`` failed: the outage starts (once)."""
        if not self.up or epoch != self.epoch:
            return
        self.up, self.down_since, self.outages = False, time.monotonic(), self.outages + 1
        self._schedule()
        log.warning("draft service failed: speculation off, requests go on with one-token rounds",
                    error=error, retry_in_s=round(self.retry_at - self.down_since, 2))

    def succeeded(self) -> None:
        """A draft call returned: the next outage starts from the shortest backoff."""
        self.backoff = self.min_backoff

    def _schedule(self) -> None:
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(2 * self.backoff, self.max_backoff)

    async def _check(self) -> None:
        try:
            ok = await self.probe()
        except Exception:  # a probe that breaks counts as "not ready"
            ok = False
        if self.up:
            return
        if not ok:
            self._schedule()
            return
        self.up, self.epoch = True, self.epoch + 1
        log.info("draft service ready again: speculation resumes",
                 outage_s=round(time.monotonic() - self.down_since, 2))
