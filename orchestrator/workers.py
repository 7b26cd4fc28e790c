"""Clients of the two workers (specdec.v2): one bidirectional ``Session`` stream per request
and worker, opened by the request's first message and ended by ``release``. Implements
``generation.TargetClient`` / ``DraftClient``; every message is built and read by
``protocol.wire``; context features pass through as opaque ``Tensor`` messages.

A session runs over gRPC, or over the worker's data channel (``serving.datachannel``: the same
messages in frames on a Unix socket, ``SocketCall``) when the worker advertises one in GetInfo
that answers from this host as that worker (``probe``: our uid, its instance nonce, our token)
and ``data_channel`` allows it (``--data-channel auto|grpc|socket``). The choice is made again
(``refresh``) when a session's socket turns out not to be the worker's (gone, another process's,
a restarted worker's) and when the worker becomes ready again."""
from __future__ import annotations

import asyncio
import collections
import json
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.steps import StepSender
from protocol import wire
from protocol.types import Mode, Prefilled, SamplingParams, Verified
from serving import datachannel as dc
from serving.logs import session_metadata
from serving.security import secure_or_insecure
from serving.server import channel_options
from specdec_proto.v1 import common_pb2
from specdec_proto.v2 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


SEND_FAILED = "Internal error from Core"
"""The details of the INTERNAL status gRPC's asyncio client gives a stream whose write failed in
its own core (``_cython_call.set_internal_error`` in grpc/aio/_call.py): our side could not
send, e.g. the worker died and the connection broke before its status arrived. Not the
worker's error: ``_Sessions.named`` reports it as UNAVAILABLE, like the read that would have seen
the connection close."""


async def readiness(channel: grpc.aio.Channel, service: str) -> tuple[bool, str]:
    """(ready, why not): ready when the worker's grpc.health.v1 readiness (``service``, its
    full name) is SERVING; otherwise the status it reported or the call's error (e.g.
    "UNAVAILABLE: failed to connect to all addresses …")."""
    try:
        r = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    except grpc.aio.AioRpcError as e:
        return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    return r.status == health_pb2.HealthCheckResponse.SERVING, f"readiness {status}"


async def is_ready(channel: grpc.aio.Channel, service: str) -> bool:
    """True when the worker's grpc.health.v1 readiness (``service``, its full name) is SERVING."""
    return (await readiness(channel, service))[0]


class WorkerTimeout(Exception):
    """A worker did not become SERVING within the start-up timeout; the message names it, its
    address, the last health error and a hint (TLS, address)."""


async def wait_serving(channel: grpc.aio.Channel, service: str, timeout: float, log=None, role: str = "worker",
                       address: str = "", tls: bool = False, every: float = 10.0) -> None:
    """Poll the worker's readiness until SERVING; logs "waiting for <role> at <address>" with
    the last health error every ``every`` s; raises ``WorkerTimeout`` after ``timeout`` s."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    next_log = start + every
    while True:
        ok, why = await readiness(channel, service)
        if ok:
            return
        now = loop.time()
        if now - start > timeout:
            raise WorkerTimeout(f"{role} at {address} did not become SERVING within {timeout:g} s "
                                f"(last health check: {why}); {_hint(why, tls)}")
        if log is not None and now >= next_log:
            # a worker that answers NOT_SERVING is loading (info); one that does not answer, a problem
            (log.info if why.startswith("readiness") else log.warning)(
                f"waiting for {role} at {address}: {why}", waited_s=round(now - start, 1))
            next_log = now + every
        await asyncio.sleep(0.2)


def _hint(why: str, tls: bool) -> str:
    if "readiness" in why:
        return "it answers but is still loading or draining"
    if tls:
        return "check the address, and that --worker-tls-ca signed its certificate (which must name that host)"
    return ("check the address and that it is running; if the worker serves TLS, start the orchestrator "
            "with --worker-tls-ca")


#: under ``--data-channel auto``, a worker that advertises a data socket but was left on gRPC (a
#: session refused for a passing reason, e.g. its limit of connections waiting for OPEN) has its
#: channel chosen again after this many seconds (``follow_workers``)
RECHOOSE_S = 10.0


async def follow_workers(host, target: "TargetWorker", draft: "DraftWorker", log, period: float = 1.0,
                         state: dict | None = None, health=None, rechoose_s: float = RECHOOSE_S) -> None:
    """Keep the orchestrator's readiness equal to "the target is ready", checked every
    ``period`` s: NOT_SERVING while the target is not ready or unreachable, SERVING again once
    it is back (``state["target_ready"]`` mirrors it, so new requests are refused meanwhile).
    The drafter's state does not change readiness: without it requests go on with one-token
    rounds; a failed draft health check opens ``health``'s outage (``orchestrator.fallback``)
    even when no draft call has failed yet (a hung drafter), and a passed one ends it (the
    breaker's own probe, so a drafter that does not fit the target stays out). A worker that
    is ready again has its data channel chosen again (``refresh``: it may have restarted with
    another socket, or none), and so, every ``rechoose_s`` s, has one left on gRPC under "auto"
    while its last GetInfo advertised a socket. Runs until cancelled."""
    seen = (True, True)
    loop = asyncio.get_running_loop()
    rechoose_at = loop.time() + rechoose_s
    while True:
        now = await is_ready(target.channel, target.service), await is_ready(draft.channel, draft.service)
        due = loop.time() >= rechoose_at
        if due:
            rechoose_at = loop.time() + rechoose_s
        for worker, ready, was in ((target, now[0], seen[0]), (draft, now[1], seen[1])):
            if ready and (not was or (due and worker.left_on_grpc())):
                await worker.refresh()
        if state is not None:
            state["target_ready"] = now[0]
        if health is not None and not now[1]:
            health.failed(health.epoch, "draft service not ready (health check)")
        elif health is not None and not health.up:
            await health.check_now()  # ready again: end the outage (probe due), not at some request's next probe
        if now[0] != seen[0]:
            await host.set_status(now[0])
        if now != seen:
            log.info("workers ready" if all(now) else "worker not ready", target=now[0], draft=now[1])
        seen = now
        await asyncio.sleep(period)


@dataclass(frozen=True)
class Pings:
    """Keepalive pings on a worker link: after ``every_ms`` without traffic the orchestrator
    pings the worker; a worker whose gRPC transport does not answer within ``timeout_ms``
    (a hung process: SIGSTOP, a frozen host, a dead network path) has the link closed, so every
    exchange in flight on it ends at once with UNAVAILABLE instead of at the client's deadline.
    A worker busy with a long forward still answers (pings are answered by gRPC's own threads,
    not the service's event loop), so a slow-but-alive CPU target never trips it. The workers
    accept pings at any rate (``serving.server.ACCEPT_PINGS``)."""

    every_ms: int = 1000
    timeout_ms: int = 2000

    def options(self) -> list[tuple[str, int]]:
        return [("grpc.keepalive_time_ms", self.every_ms), ("grpc.keepalive_timeout_ms", self.timeout_ms),
                ("grpc.http2.ping_timeout_ms", self.timeout_ms),  # (the one gRPC >= 1.6x applies to every ping)
                ("grpc.http2.max_pings_without_data", 0)]  # keep pinging through a long forward


class DataChannelError(Exception):
    """``--data-channel socket`` and a worker without a usable data channel (the message says
    which worker and why)."""


class _Frames(asyncio.Protocol):
    """Cuts the worker's byte stream into frames for ``SocketCall``."""

    def __init__(self, call: "SocketCall"):
        self.call, self.buf = call, bytearray()

    def data_received(self, data: bytes) -> None:
        h = dc.HEADER.size
        if not self.buf and len(data) >= h:  # the usual case: exactly one whole frame
            n, kind = dc.HEADER.unpack_from(data)
            if len(data) == h + n:
                self.call.frame(kind, data[h:])
                return
        buf = self.buf
        buf += data
        at, end = 0, len(buf)
        while end - at >= dc.HEADER.size:
            n, kind = dc.HEADER.unpack_from(buf, at)
            if end - at - dc.HEADER.size < n:
                break
            self.call.frame(kind, bytes(buf[at + dc.HEADER.size:at + dc.HEADER.size + n]))
            at += dc.HEADER.size + n
        del buf[:at]

    def connection_lost(self, exc) -> None:
        self.call.lost(exc)


HELLO_TIMEOUT = 5.0  # s: a data socket's worker sends HELLO at accept; none within this: not usable


def peer_problem(sock) -> str:
    """Why the process at the other end of Unix socket ``sock`` is not one of ours ("" when it
    runs as this process's user: ``SO_PEERCRED``, Linux; elsewhere not checked)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return ""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.geteuid():
        return f"is served by process {pid} of uid {uid}, not of this process's uid {os.geteuid()}"
    return ""


class _Spin:
    """Busy-polling of the orchestrator's event loop (``SPECDEC_SPIN_US``; unset: on for hosts with
    ≥ 8 CPUs, see ``serving.datachannel.spin_settings``): while at most ``SPECDEC_SPIN_MAX_LIVE`` requests
    have data-channel sessions open (two sockets each), an event loop with nothing to run polls
    its selector for up to that long before it sleeps in ``epoll_wait``, so a worker's reply
    finds it awake. Installed on a loop at its first data-channel session by wrapping its
    selector's ``select`` (asyncio's selector loops keep it in ``_selector``; a loop without one,
    e.g. uvloop, does not poll)."""
    live = 0  # data-channel sockets open in this process

    @classmethod
    def opened(cls, call: "SocketCall", loop) -> None:
        cls.live += 1
        call.counted = True
        sel = getattr(loop, "_selector", None)
        if sel is None or getattr(sel, "spin_installed", False):
            return
        sel.spin_installed = True
        spin_s, max_live = dc.spin_settings()
        if spin_s <= 0:
            return
        select = sel.select

        def polling_select(timeout=None):
            if (timeout is None or timeout > 0) and 0 < cls.live <= 2 * max_live:
                until = time.perf_counter() + (spin_s if timeout is None else min(spin_s, timeout))
                while not (ready := select(0)):
                    if time.perf_counter() >= until:
                        return select(None if timeout is None else max(0.0, timeout - spin_s))
                    os.sched_yield()
                return ready
            return select(timeout)
        sel.select = polling_select

    @classmethod
    def closed(cls, call: "SocketCall") -> None:
        if getattr(call, "counted", False):
            call.counted = False
            cls.live -= 1


class SocketCall:
    """A ``Session`` over a worker's data channel, quacking like ``grpc.aio.StreamStreamCall``
    for ``_Sessions``: ``write`` (connects on first use — ``connect`` — and sends ``OPEN`` with
    ``metadata`` and ``timeout``), ``read`` (the next reply, ``grpc.aio.EOF`` after the worker's ``END``,
    ``grpc.aio.AioRpcError`` with the worker's status after its ``ERROR`` or when the socket
    closed: UNAVAILABLE), ``done_writing`` (``END``), ``cancel`` (closes the socket: the worker
    frees the request at once), ``done``, ``code``, ``details`` (awaited: once the worker closed).
    ``reply_type``: the protobuf class of one reply. ``nonce``: the worker's instance nonce from
    GetInfo ("": not checked). ``rpc``: "Session" or "Steps" (``serving.steps``). ``refused``: the
    session ended before the worker ran it (nothing to undo there; ``_Sessions.exchange``
    re-chooses the channel and retries)."""

    def __init__(self, path: str, metadata, timeout: float | None, reply_type, token: str = "", nonce: str = "",
                 rpc: str = "Session"):
        self.path, self.reply_type, self.timeout, self.nonce = path, reply_type, timeout, nonce
        md = list(metadata) + ([("authorization", f"Bearer {token}")] if token else [])
        head = {"metadata": md, "timeout": timeout} | ({} if rpc == "Session" else {"rpc": rpc})
        self.open_frame = dc.frame(dc.OPEN, json.dumps(head).encode())
        self.replies: collections.deque[bytes] = collections.deque()
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.transport = None
        self.sent = self.replied = False  # OPEN sent; a MESSAGE came back
        self.waiter: asyncio.Future | None = None
        loop = asyncio.get_running_loop()
        self.closed, self.hello = loop.create_future(), loop.create_future()  # hello: the worker's nonce (None: ended)

    async def write(self, msg) -> None:
        if self.status is not None:
            raise self.error()
        payload = dc.frame(dc.MESSAGE, msg.SerializeToString())
        if self.transport is None:
            await self.connect(payload)
        else:
            self.transport.write(payload)

    async def connect(self, first: bytes = b"") -> None:
        """Connect, check that the peer is the worker before anything is sent (the socket file
        and the listening process are this user's; its ``HELLO`` carries ``nonce``), then send
        ``OPEN`` + ``first``. Not the worker: the call ends UNAVAILABLE naming why (raised as
        ``AioRpcError``; ``refused``)."""
        why = await self._peer()
        if self.status is None and why:
            self.fail(grpc.StatusCode.UNAVAILABLE, why)
        if self.status is not None:  # (also: cancelled or lost while connecting)
            if self.transport is not None:
                self.transport.abort()
            raise self.error()
        self.sent = True
        self.transport.write(self.open_frame + first)

    async def _peer(self) -> str:
        try:
            st = os.stat(self.path)
            if st.st_uid != os.geteuid():
                return f"data socket {self.path} belongs to uid {st.st_uid}, not to this process's uid {os.geteuid()}"
            loop = asyncio.get_running_loop()
            self.transport, _ = await loop.create_unix_connection(lambda: _Frames(self), self.path)
            _Spin.opened(self, loop)
        except OSError as e:
            return f"cannot connect to data socket {self.path}: {e}"
        why = peer_problem(self.transport.get_extra_info("socket"))
        if why:
            return f"data socket {self.path} {why}"
        try:
            hello = await asyncio.wait_for(asyncio.shield(self.hello), HELLO_TIMEOUT)
        except asyncio.TimeoutError:
            return f"data socket {self.path} sent no HELLO within {HELLO_TIMEOUT:g} s"
        if hello is not None and self.nonce and hello != self.nonce:
            return (f"data socket {self.path} is served by another process than the worker that advertised it "
                    "(instance nonce differs: the worker restarted, or the path is another process's)")
        return ""

    @property
    def refused(self) -> bool:
        return self.status is not None and (
            (not self.sent and self.status[0] != grpc.StatusCode.CANCELLED)
            or (self.status[0] == grpc.StatusCode.UNAUTHENTICATED and not self.replied))

    async def read(self):
        while not self.replies:
            if self.status is not None:
                if self.status[0] == grpc.StatusCode.OK:
                    return grpc.aio.EOF
                raise self.error()
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.reply_type.FromString(self.replies.popleft())

    def error(self) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(self.status[0], grpc.aio.Metadata(), grpc.aio.Metadata(), self.status[1])

    def frame(self, kind: int, payload: bytes) -> None:
        if kind == dc.MESSAGE:
            self.replied = True
            self.replies.append(payload)
        elif kind == dc.HELLO:
            if not self.hello.done():
                self.hello.set_result(payload.decode(errors="replace"))
        elif kind == dc.END:
            self.end(grpc.StatusCode.OK, "")
        elif kind == dc.ERROR:
            self.end(*dc.parse_error(payload))
        self._wake()

    def lost(self, exc) -> None:
        _Spin.closed(self)
        self.end(grpc.StatusCode.UNAVAILABLE, f"the worker closed its data socket{f' ({exc})' if exc else ''}")
        if not self.closed.done():
            self.closed.set_result(None)

    def end(self, code: grpc.StatusCode, details: str) -> None:
        """The session's status (the first one set wins)."""
        if self.status is None:
            self.status = (code, details)
        if not self.hello.done():
            self.hello.set_result(None)
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        """End it here with ``code`` (exchanges in flight raise it) and close the socket."""
        self.end(code, details)
        if self.transport is not None:
            self.transport.abort()
        elif not self.closed.done():
            self.closed.set_result(None)

    def cancel(self) -> None:
        self.fail(grpc.StatusCode.CANCELLED, "Locally cancelled")

    def done(self) -> bool:
        return self.status is not None

    async def done_writing(self) -> None:
        if self.transport is not None and self.status is None:
            self.transport.write(dc.frame(dc.END))

    async def code(self) -> grpc.StatusCode:
        if self.transport is None:
            self.end(grpc.StatusCode.OK, "")  # never opened: nothing to wait for
        else:
            await self.closed
        return self.status[0]

    async def details(self) -> str:
        await self.code()
        return self.status[1]


def usable_socket(path: str) -> str:
    """Why ``path`` cannot be this host's data channel to a worker ("" when it can): empty, or
    not a Unix socket here (the worker runs on another host or in another container)."""
    if not path:
        return "advertises no data socket (start it with --data-socket)"
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            return ""
        return f"advertises data socket {path}, which is not a socket on this host"
    except OSError as e:
        return f"advertises data socket {path}, not found on this host ({e.strerror})"


class _Sessions:
    """Open ``Session`` streams by worker id. ``label`` names the worker in errors.
    ``credentials``: TLS / mutual TLS on the link (``serving.security``); None = plain text.
    ``data_channel``: "auto" (the worker's data socket when GetInfo advertises one that passes
    ``probe`` from this host, else gRPC), "grpc", or "socket" (``info()`` raises
    ``DataChannelError`` without one); chosen by ``info()`` (again by ``refresh``), in
    ``data_socket`` ("" = gRPC) and ``data_nonce``. Socket sessions send ``SPECDEC_DATA_TOKEN``
    (if set) as their bearer token; a worker that refuses it is not used under "auto" (a
    warning names the setting: the token guards only the socket, gRPC has its own auth, so
    the service goes on, slower) and stops the start under "socket".
    ``steps``: a request's rounds after its first go through one ``Steps`` stream per worker
    (``orchestrator.steps.StepSender``, ``self.steps``; on the chosen channel) instead of its
    Session, which keeps the open, the release and the deadline."""

    label = "worker"
    reply_type = None  # the Session reply message class
    steps_reply_type = None  # the Steps reply message class

    def __init__(self, address: str, max_message_mb: int, stub_class, pings: Pings | None = None,
                 credentials: grpc.ChannelCredentials | None = None, data_channel: str = "auto",
                 steps: bool = False):
        if data_channel not in ("auto", "grpc", "socket"):
            raise ValueError(f"--data-channel must be auto, grpc or socket, got {data_channel!r}")
        self.max_bytes = max_message_mb * 2 ** 20
        self.steps: StepSender | None = self._step_sender() if steps else None
        self.address, self.pings, self.data_channel = address, pings or Pings(), data_channel
        self.data_socket, self.data_nonce, self.token = "", "", os.environ.get("SPECDEC_DATA_TOKEN", "")
        self._watchdog = self._refreshing = None
        self._logged: tuple | None = None  # the choice last logged
        self._advertised = ""  # the data socket the last GetInfo advertised
        # reconnect within a second or two of a restarted worker (gRPC's default backoff grows to 2 min)
        self.channel = secure_or_insecure(True, address, credentials, options=channel_options(max_message_mb) + [
            ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)]
            + self.pings.options())
        self.stub = stub_class(self.channel)
        self.calls: dict[str, grpc.aio.StreamStreamCall | SocketCall] = {}

    def open(self, worker_id: str, timeout: float | None = None) -> grpc.aio.StreamStreamCall | SocketCall:
        """``timeout``: the session's deadline in seconds (the client's, passed on: the worker
        ends the session and frees the request when it passes)."""
        if self.data_socket:
            call = self.calls[worker_id] = SocketCall(self.data_socket, session_metadata(worker_id), timeout,
                                                      self.reply_type, self.token, self.data_nonce)
            if self._watchdog is None or self._watchdog.done():
                self._watchdog = asyncio.ensure_future(self._liveness())
            return call
        call = self.calls[worker_id] = self.stub.Session(metadata=session_metadata(worker_id), timeout=timeout)
        return call

    def _step_sender(self) -> StepSender:
        raise NotImplementedError

    def via_steps(self) -> bool:
        """This round goes through the ``Steps`` stream: steps are on and this process has other
        sessions open with the worker, or rounds queued or in flight on it (a lone request
        exchanges on its own Session: no step to share, no hop)."""
        return self.steps is not None and (len(self.calls) > 1 or self.steps.busy)

    async def via_steps_submit(self, request_id: str, item, what: str):
        """``steps.submit(item)``; a failed item of a request whose Session has ended (its deadline,
        a cancel: the worker had already freed it, so the item found no request — NOT_FOUND)
        raises the Session's own status instead, as a per-request exchange would have."""
        try:
            return await self.steps.submit(item)
        except grpc.aio.AioRpcError as e:
            call = self.calls.get(request_id)
            if call is None or e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            try:  # (the Session's end may still be on its way: a moment at most, on this error path only)
                code = await asyncio.wait_for(asyncio.shield(call.code()), 1.0)
                details = await call.details()
            except (asyncio.TimeoutError, grpc.aio.AioRpcError):
                raise e from None
            if code == grpc.StatusCode.OK:
                raise
            raise self.named(code, details, what) from None

    def open_steps(self):
        """A new ``Steps`` stream on the chosen channel (no deadline: it holds no request)."""
        md = (("x-worker-id", f"steps-{os.getpid()}"),)
        if self.data_socket:
            call = SocketCall(self.data_socket, md, None, self.steps_reply_type, self.token, self.data_nonce, "Steps")
            if self._watchdog is None or self._watchdog.done():
                self._watchdog = asyncio.ensure_future(self._liveness())
            return call
        return self.stub.Steps(metadata=md)

    async def pick_channel(self, info) -> None:
        """Choose the channel from the worker's GetInfo (``data_socket``, ``data_nonce``):
        ``probe`` it unless "grpc", then ``choose_channel``."""
        why = "--data-channel grpc" if self.data_channel == "grpc" else await self.probe(info.data_socket,
                                                                                        info.data_nonce)
        self.choose_channel(info.data_socket, info.data_nonce, why)

    def choose_channel(self, advertised: str, nonce: str = "", why: str | None = None) -> None:
        """Set ``data_socket`` / ``data_nonce`` from what the worker advertised (``data_channel``
        rules) and log the choice; ``why``: why it cannot be used ("" = it can; None = only the
        file is checked, ``usable_socket``: the bench's stub target has no GetInfo).
        ``DataChannelError`` under "socket" when it is not usable."""
        if why is None:
            why = "--data-channel grpc" if self.data_channel == "grpc" else usable_socket(advertised)
        if why and self.data_channel == "socket":
            raise DataChannelError(f"--data-channel socket: the {self.label} at {self.address} {why}")
        chosen = "" if why else advertised
        if (chosen, why) != self._logged:
            self._logged = chosen, why
            (structlog.get_logger().warning if why and advertised else structlog.get_logger().info)(
                "data channel", worker=self.label, address=self.address, channel="socket" if chosen else "grpc",
                path=chosen or None, why=why or None)
        self.data_socket, self.data_nonce = chosen, nonce if chosen else ""
        self._advertised = advertised

    async def probe(self, path: str, nonce: str) -> str:
        """Why ``path`` cannot be this worker's data channel ("" when it can): not advertised,
        not a socket on this host (the worker runs elsewhere), not this user's, not the worker
        that answered GetInfo (``nonce``), or it refuses our token (``SPECDEC_DATA_TOKEN``).
        One connection opened with an expired deadline: the worker checks the token and
        answers DEADLINE_EXCEEDED without running anything."""
        why = usable_socket(path)
        if why:
            return why
        if not nonce:
            return f"advertises data socket {path} without an instance nonce (an older worker)"
        call = SocketCall(path, session_metadata("data-channel-probe"), 0, self.reply_type, self.token, nonce)
        try:
            await asyncio.wait_for(call.connect(), HELLO_TIMEOUT)
            await asyncio.wait_for(call.read(), HELLO_TIMEOUT)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return ""
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return (f"refuses this orchestrator's bearer token on data socket {path} ({e.details()}): set "
                        "SPECDEC_DATA_TOKEN to the workers' value")
            return e.details() if call.refused else f"data socket {path}: {e.code().name}: {e.details()}"
        except asyncio.TimeoutError:
            return f"data socket {path} did not answer within {HELLO_TIMEOUT:g} s"
        finally:
            call.cancel()
        return f"data socket {path} did not refuse a session with an expired deadline"

    def left_on_grpc(self) -> bool:
        """Under "auto", on gRPC although the worker's last GetInfo advertised a data socket."""
        return self.data_channel == "auto" and not self.data_socket and bool(self._advertised)

    async def refresh(self) -> None:
        """GetInfo again and choose the channel again (the worker restarted: its socket gone,
        moved, another process's, a new nonce or token). Concurrent callers share one; when
        the worker does not answer (or under "socket" nothing usable), the choice stays and the
        reason is logged."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._refresh())
        await asyncio.shield(self._refreshing)

    async def _refresh(self) -> None:
        try:
            await asyncio.wait_for(self.info(), 2 * HELLO_TIMEOUT)
        except (grpc.aio.AioRpcError, DataChannelError, asyncio.TimeoutError) as e:
            structlog.get_logger().warning("data channel not chosen again", worker=self.label, address=self.address,
                                           why=(e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e))
                                           or "GetInfo timed out")

    async def _liveness(self) -> None:
        """While socket sessions are open, the gRPC keepalive's job for them: every
        ``pings.every_ms`` a health check on the worker's gRPC port; one unanswered within
        ``pings.timeout_ms`` (a hung process) fails every socket session at once with
        UNAVAILABLE (a busy worker still answers: gRPC's threads do)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        wait = self.pings.timeout_ms / 1000
        while any(isinstance(c, SocketCall) for c in self.calls.values()) or (
                self.steps is not None and isinstance(self.steps.call, SocketCall)):
            await asyncio.sleep(self.pings.every_ms / 1000)
            try:
                await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=wait)
            except grpc.aio.AioRpcError as e:
                if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    continue
                why = (f"stopped answering: no reply to a keepalive ping within {wait:g} s (a health check "
                       f"on its gRPC port, the data channel's liveness probe: {e.code().name})")
                for call in [c for c in self.calls.values() if isinstance(c, SocketCall)]:
                    call.fail(grpc.StatusCode.UNAVAILABLE, why)
                if self.steps is not None and isinstance(self.steps.call, SocketCall):
                    self.steps.call.fail(grpc.StatusCode.UNAVAILABLE, why)

    async def exchange(self, call: grpc.aio.StreamStreamCall, msg, what: str):
        """Write one message, read its one reply. A worker error raises AioRpcError, its details
        naming this worker and ``what`` was asked (e.g. "verify"). A data-channel session
        ``refused`` before the worker ran it (its socket not the worker's any more, our token
        refused) is opened once more on the channel ``refresh`` chooses (the same deadline)."""
        try:
            try:
                await call.write(msg)
                reply = await call.read()
            except grpc.aio.AioRpcError:
                if not (isinstance(call, SocketCall) and call.refused):
                    raise
                call = await self._reopen(call)
                await call.write(msg)
                reply = await call.read()
        except grpc.aio.AioRpcError as e:
            raise self.named(e.code(), e.details(), what) from None
        except asyncio.InvalidStateError:  # the stream ended (worker gone) before this write
            raise self.named(await call.code(), await call.details(), what) from None
        if reply is grpc.aio.EOF:
            raise self.named(await call.code(), await call.details() or "worker ended the session", what)
        return reply

    async def _reopen(self, call: SocketCall):
        """``call``'s session opened again after ``refresh`` (the same worker id and deadline);
        its error again when it was released meanwhile."""
        await self.refresh()
        worker_id = next((k for k, c in self.calls.items() if c is call), None)
        if worker_id is None:
            raise call.error()
        return self.open(worker_id, call.timeout)

    def named(self, code: grpc.StatusCode, details: str | None, what: str) -> grpc.aio.AioRpcError:
        """The worker's error, its details saying which worker, at which address, during what; a
        write that failed in gRPC's own core (``SEND_FAILED``) as UNAVAILABLE, whichever call of
        the stream reports it (that write's, or a later one's on the ended stream)."""
        details = details or code.name
        if code == grpc.StatusCode.INTERNAL and details == SEND_FAILED:  # our side could not send: the link broke
            code, details = grpc.StatusCode.UNAVAILABLE, f"the connection broke while sending ({SEND_FAILED})"
        if "ping timeout" in details:
            details = (f"stopped answering: no reply to a keepalive ping within {self.pings.timeout_ms / 1000:g} s "
                       f"({details})")
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                    f"{self.label} at {self.address}, {what}: {details}")

    async def release(self, worker_id: str, abort: bool = False) -> None:
        """End the stream; returns once the worker has freed the request's state. ``abort``:
        cancel it instead (returns at once; the worker frees the state when it sees the
        cancellation, a prefill at its next chunk)."""
        call = self.calls.pop(worker_id, None)
        if call is None or call.done():
            return
        if abort:
            call.cancel()
            return
        await call.done_writing()
        await asyncio.wait_for(call.code(), 10)


class TargetWorker(_Sessions):
    service = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
    label = "target service"
    reply_type = target_pb2.TargetReply
    steps_reply_type = target_pb2.TargetStepReply

    def __init__(self, address: str, max_message_mb: int = 64, pings: Pings | None = None,
                 credentials: grpc.ChannelCredentials | None = None, data_channel: str = "auto",
                 steps: bool = False):
        super().__init__(address, max_message_mb, target_pb2_grpc.TargetServiceStub, pings, credentials, data_channel,
                         steps)
        self.holding: dict[str, int] = {}  # request → feature rows the worker holds for it (a held open or verifies)
        self.row_bytes = 0  # bytes of a feature row (from GetInfo: taps × hidden × the dtype's size)

    def _step_sender(self) -> StepSender:
        return StepSender(self, wire.target_step, lambda r: wire.step_results(r, "verified", wire.verified_from),
                          "verify", self.max_bytes)

    async def info(self) -> target_pb2.TargetInfo:
        """GetInfo; also picks the data channel (``pick_channel``; DataChannelError)."""
        info = await self.stub.GetInfo(common_pb2.InfoRequest())
        await self.pick_channel(info)
        size = {"float32": 4, "float64": 8}.get(info.dtype, 2)
        self.row_bytes = len(info.taps) * info.hidden_size * size
        return info

    async def prefill(self, request_id: str, prompt: list[int], max_new_tokens: int, sampling: SamplingParams,
                      mode: Mode, tree_budget: int, timeout: float | None = None, hold: bool = False) -> Prefilled:
        """``hold``: the worker keeps the prompt's feature rows (the reply has none), as
        ``verify``'s ``hold`` keeps a round's."""
        call = self.open(request_id, timeout)
        reply = await self.exchange(call, wire.target_open(prompt, max_new_tokens, sampling, mode, tree_budget, hold),
                                    "prefill")
        out = wire.opened_from_proto(reply)
        if hold and out.features is None:
            self.holding[request_id] = len(prompt)
        return out

    async def verify(self, request_id: str, tokens: list[int], parents: list[int],
                     commit: list[int] | None, hold: bool = False) -> Verified:
        """``hold``: the worker keeps this round's feature rows (the reply has none); the first
        verify without it after rows were held fetches them (``Verified.held_rows``) — on the
        request's own Session, never in a ``Steps`` message (a prompt's rows, or hundreds of held
        rounds', for each of many requests would pass a message's limit). A hold whose fetch would
        pass half the message limit (``max_message_mb``) goes without hold: its reply brings the
        held rows, as from a target that predates hold."""
        held = self.holding.get(request_id)
        if hold and held is not None and (held + len(tokens)) * self.row_bytes > self.max_bytes // 2:
            hold = False
        fetch = not hold and held is not None
        if self.via_steps() and not fetch:
            out = await self.via_steps_submit(request_id, (request_id, tokens, parents, commit, hold), "verify")
        else:
            out = wire.verified_from_proto(await self.exchange(
                self.calls[request_id], wire.target_verify(tokens, parents, commit, hold), "verify"))
        if hold and out.features is None:
            self.holding[request_id] = (held or 0) + len(out.feature_nodes)
        elif fetch:
            del self.holding[request_id]
        return out

    async def release(self, worker_id: str, abort: bool = False) -> None:
        self.holding.pop(worker_id, None)
        await super().release(worker_id, abort)


class DraftWorker(_Sessions):
    """``max_context``, ``block_size`` and ``max_tree_budget`` come from the drafter's GetInfo
    (``info()``). Until then (the orchestrator started without the drafter) the block size is
    assumed to be ``ASSUMED_BLOCK`` (a chain request's target session is opened for
    ``block_size - 1`` nodes), and a request admitted then may later ask for more than the
    drafter gives: its tree budget is cut to ``max_tree_budget``, its chains to the budget its
    target session was opened with (a shorter draft only proposes less)."""

    ASSUMED_BLOCK = 16  # the shipped drafters' block size
    service = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
    label = "draft service"

    reply_type = draft_pb2.DraftReply
    steps_reply_type = draft_pb2.DraftStepReply

    def __init__(self, address: str, max_message_mb: int = 64, pings: Pings | None = None,
                 credentials: grpc.ChannelCredentials | None = None, data_channel: str = "auto",
                 steps: bool = False):
        super().__init__(address, max_message_mb, draft_pb2_grpc.DraftServiceStub, pings, credentials, data_channel,
                         steps)
        self.max_context, self.block_size, self.max_tree_budget = 0, self.ASSUMED_BLOCK, 0

    def _step_sender(self) -> StepSender:
        return StepSender(self, wire.draft_step,
                          lambda r: wire.step_results(r, "tree", lambda t: (t.tree.tokens[:], t.tree.parents[:])),
                          "draft", self.max_bytes)

    async def info(self) -> draft_pb2.DraftInfo:
        """GetInfo: the drafter's limits, and the data channel (``pick_channel``; DataChannelError)."""
        info = await self.stub.GetInfo(common_pb2.InfoRequest())
        await self.pick_channel(info)
        self.max_context, self.block_size = info.max_context, info.block_size
        self.max_tree_budget = info.max_tree_budget
        return info

    async def draft(self, request_id: str, features, context_start: int, bonus: int, mode: Mode,
                    tree_budget: int, timeout: float | None = None,
                    round_budget: int | None = None) -> tuple[list[int], list[int]]:
        """``round_budget``: this round's tree budget (tree mode; None = ``tree_budget``, the
        budget the session binds at open), cut to it."""
        call = self.calls.get(request_id)
        first = call is None
        if first:
            call = self.open(request_id, timeout)
        if self.max_tree_budget:
            tree_budget = min(tree_budget, self.max_tree_budget)
        if round_budget is not None:
            round_budget = min(round_budget, tree_budget)
        if not first and self.via_steps():
            tokens, parents = await self.via_steps_submit(
                request_id, (request_id, features, context_start, bonus, round_budget), "draft")
        else:
            msg = wire.draft_message(features, context_start, bonus, mode if first else None, tree_budget,
                                     round_budget)
            r = await self.exchange(call, msg, "draft")
            tokens, parents = r.tree.tokens[:], r.tree.parents[:]  # (lists; a slice copies faster than list())
        if mode == Mode.CHAIN and len(tokens) - 1 > tree_budget:  # (block size learnt after the session opened)
            tokens, parents = tokens[:tree_budget + 1], parents[:tree_budget + 1]
        return tokens, parents
