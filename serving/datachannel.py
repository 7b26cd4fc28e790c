"""The data channel: a worker's ``Session`` stream over a Unix domain socket, next to gRPC.

Why: one message exchange on an open gRPC stream costs ≥ 0.28 ms on the H200 host and a round
needs two (plans/0004 "The floor"); length-prefixed frames on a plain socket cost 40–140 µs. So
a worker started with ``--data-socket PATH`` (``SPECDEC_DATA_SOCKET``; off by default) also
serves its Session stream on that socket, and advertises the path in GetInfo
(``TargetInfo.data_socket`` / ``DraftInfo.data_socket``); an orchestrator on the same host uses
it for the per-round messages (``orchestrator.workers``, ``--data-channel``). gRPC keeps
health, GetInfo, reflection, TLS, the orchestrator's liveness probe and the default path.

Unix-only on purpose: the channel is for colocated processes; the socket file's permissions
(0600: the worker's user only) are the access control, so no TLS is needed, and a path cannot
be reached from another host by mistake. Workers in separate hosts or containers stay on gRPC.

Protocol (both directions): frames of ``HEADER`` (payload length in bytes, uint32 big-endian;
kind, uint8) + payload. One connection is one Session:

- worker → client, at once on accept: ``HELLO``, the worker's instance nonce (random per
  process start, also in GetInfo's ``data_nonce``). The client checks it (and the peer's uid,
  ``SO_PEERCRED``) before it sends anything: a socket left at the path by another process (a
  restarted worker without ``--data-socket``, a decoy, another host's path) gets no prompt and
  no token.
- client → worker: ``OPEN`` first (within ``OPEN_TIMEOUT`` s; at most ``MAX_OPENING``
  connections may wait for theirs, more are refused RESOURCE_EXHAUSTED), a JSON object
  ``{"metadata": [[key, value], …], "timeout": seconds or null, "rpc": name}`` (``rpc``: which
  stream — "Session", the default, or "Steps", many requests' rounds a message
  (``serving.steps``); another name is refused UNIMPLEMENTED; metadata as gRPC's:
  ``x-worker-id``, ``x-request-id``, ``authorization: Bearer <token>`` when the worker requires
  a token; a finite timeout, ≤ 0 answered DEADLINE_EXCEEDED without running anything: the
  orchestrator's probe); then ``MESSAGE`` frames, each one serialized specdec.v2
  ``TargetMessage`` / ``DraftMessage`` (``TargetStep`` / ``DraftStep`` on a Steps stream);
  ``END`` = no more messages (gRPC's half-close).
  Closing the socket without ``END`` cancels the session (the worker frees the request at
  once, as for a cancelled gRPC stream). Any other frame (a second ``OPEN``, an
  ``ERROR``, an unknown kind) ends the session INVALID_ARGUMENT.
- worker → client: one ``MESSAGE`` (a serialized ``TargetReply`` / ``DraftReply``) per
  message; then ``END`` (status OK) or ``ERROR`` (JSON ``{"code": "<grpc.StatusCode name>",
  "details": "…"}``), then it closes the socket.

The worker runs the servicer's unchanged ``Session(request_iterator, context)`` on one thread
per connection (like gRPC's thread-per-RPC server: a blocking read per message, no event-loop
hand-off) with ``_Context``, which quacks like ``grpc.ServicerContext`` for what the servicers,
``serving.server`` and ``serving.logs`` use. The host's accounting is the gRPC path's:
``max_sessions`` (RESOURCE_EXHAUSTED naming the limit), ``in_flight``, the drain (new
connections refused UNAVAILABLE; streams still open when the grace ran out end UNAVAILABLE).
One monitor thread per channel watches every connection for the peer's close (epoll HUP: a
cancel reaches a handler that is inside an engine call, as gRPC's ``add_callback`` does) and
for session deadlines (DEADLINE_EXCEEDED, the request freed, with ≤ ``TICK`` s delay). It never
waits on a connection: a client that stopped reading (its send blocked) has its socket shut
down instead of an ``ERROR`` frame, so deadlines and cancels of the other sessions go on.
"""
from __future__ import annotations

import contextlib
import contextvars
import hmac
import io
import json
import math
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time

import grpc
import structlog

from protocol import wire
from serving.server import DRAINING, GRACE_OVER, STEPS_FULL, ServiceHost, _checked_sync, env_default, is_steps

log = structlog.get_logger()

HEADER = struct.Struct("!IB")  # payload bytes, kind
OPEN, MESSAGE, END, ERROR, HELLO = 1, 2, 3, 4, 5
TICK = 0.25  # s: the monitor's longest sleep (deadline resolution)
OPEN_TIMEOUT = 10.0  # s: a connection that sends no OPEN within this is closed (INVALID_ARGUMENT)
MAX_OPENING = 256  # connections waiting for their OPEN at once; more are refused at accept
READ_BUFFER = 64 * 1024  # bytes: a connection's read buffer


def frame(kind: int, payload: bytes = b"") -> bytes:
    """One frame: ``HEADER`` + ``payload``."""
    return HEADER.pack(len(payload), kind) + payload


def spin_settings() -> tuple[float, int]:
    """(seconds, live limit) of busy-polling, from ``SPECDEC_SPIN_US`` and ``SPECDEC_SPIN_MAX_LIVE``
    (default 2). A receiver that expects the next message of a round within that time polls for
    it instead of sleeping, so neither the sleep nor the wake-up (an inter-processor interrupt, a
    core leaving its idle state) is paid per message — at the price of a busy core per waiting
    receiver while at most the limit of requests are live (above it nobody polls: under load
    messages queue anyway, and pollers would take cores and the GIL from the work). Pollers
    ``sched_yield`` between polls (as vLLM's shared-memory message queue does), so on a host with
    fewer free cores than pollers the process they wait for still runs (a 2-core VM: a polling
    ping-pong 19–36 µs per exchange against 24–39 blocking; without the yield, 7–8 ms).
    ``SPECDEC_SPIN_US`` unset, empty or ``auto``: ``auto_spin_us(usable_cpus())`` — on for hosts
    with idle cores (a GPU host), off on small machines (CI, a 2-core VM, a container with a small
    CPU quota); an explicit number, 0 included, always wins.
    ValueError naming the variable for a value that is not ``auto`` or an integer in its range: 0 …
    ``MAX_SPIN_US`` µs (a longer poll only burns a core per stalled session), 0 … 1024 requests."""
    raw = os.environ.get("SPECDEC_SPIN_US", "").strip()
    spin_us = auto_spin_us(usable_cpus()) if raw.lower() in ("", "auto") else \
        _env_int("SPECDEC_SPIN_US", 0, MAX_SPIN_US, "microseconds, or auto")
    return spin_us / 1e6, _env_int("SPECDEC_SPIN_MAX_LIVE", 2, 1024, "live requests")


def busy_poll_fields() -> dict:
    """The resolved busy-polling settings as log fields (every service logs them at start-up)."""
    spin_s, live = spin_settings()
    return dict(busy_poll_us=round(spin_s * 1e6) if live else 0, busy_poll_max_live=live,  # (max live 0: never polls)
                busy_poll_from=os.environ.get("SPECDEC_SPIN_US", "").strip() or "auto")


MAX_SPIN_US = 10_000  # 10 ms: a round's next message is due well within it
AUTO_SPIN_US = 1000  # ``auto``'s poll window: covers a stub round's waits (~0.3 ms) and an H200 draft call (0.27-0.35 ms);
# a verify forward (~1.2 ms) outlasts it, and the waiting thread then sleeps as without polling
AUTO_SPIN_MIN_CPUS = 8  # ``auto`` polls on hosts with at least this many usable CPUs


def auto_spin_us(cpus: int) -> int:
    """Busy-polling's window in µs when ``SPECDEC_SPIN_US`` is not set: ``AUTO_SPIN_US`` on a host
    with ≥ ``AUTO_SPIN_MIN_CPUS`` usable CPUs, 0 (off) below. Who polls: the orchestrator's event
    loop and, on each worker, the session thread of each live request, only while ≤
    ``SPECDEC_SPIN_MAX_LIVE`` (2) requests are live — 3 threads with one request, 5 with two, each
    yielding its core to anything runnable; 8 CPUs leave cores for the engines' threads and the
    rest. On fewer the pollers take the cores the awaited process needs (the 2-core VM: the stub
    round 0.85–1.04 ms polling against 0.61–0.75 without; plans/0004 "Session 7")."""
    return AUTO_SPIN_US if cpus >= AUTO_SPIN_MIN_CPUS else 0


def usable_cpus() -> int:
    """CPUs this process can use: its CPU affinity (``taskset``, cpusets), capped by a cgroup CPU
    quota (a container's CPU limit: cgroup v2 ``cpu.max`` of the process's own cgroup — from
    ``/proc/self/cgroup``, for a nested one such as a systemd scope — and of each cgroup above it;
    else v1 ``cpu.cfs_quota_us``), rounded down."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quotas = [[p + "/cpu.max"] for p in _cgroup_v2_dirs()]
    quotas.append(["/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"])
    for paths in quotas:
        try:
            fields = []
            for path in paths:
                with open(path) as f:
                    fields += f.read().split()
            quota, period = fields[0], fields[1]
            if quota not in ("max", "-1") and int(period) > 0:
                cpus = min(cpus, max(1, int(quota) // int(period)))
        except (OSError, ValueError, IndexError):
            continue
    return cpus


def _cgroup_v2_dirs() -> list[str]:
    """The cgroup v2 directories whose ``cpu.max`` bounds this process: its own (the ``0::``
    line of ``/proc/self/cgroup``) and each one above it, up to ``/sys/fs/cgroup``."""
    dirs, rel = ["/sys/fs/cgroup"], ""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    rel = line[3:].strip().strip("/")
    except OSError:
        pass
    parts = [p for p in rel.split("/") if p and p != ".."]
    dirs += ["/sys/fs/cgroup/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return dirs


def _env_int(name: str, default: int, high: int, unit: str) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    text = raw.strip()
    ok = text.isascii() and text.isdigit() and len(text.lstrip("0")) <= len(str(high))  # (no "1_000", "+5", 1e3)
    value = int(text) if ok else -1
    if not 0 <= value <= high:
        raise ValueError(f"{name} must be an integer in [0, {high}] ({unit}), got {raw!r}")
    return value


def error_payload(code: grpc.StatusCode, details: str) -> bytes:
    return json.dumps({"code": code.name, "details": details}).encode()


def parse_error(payload: bytes) -> tuple[grpc.StatusCode, str]:
    """(code, details) of an ``ERROR`` frame; an unknown code name reads as UNKNOWN."""
    e = json.loads(payload)
    return getattr(grpc.StatusCode, str(e.get("code")), grpc.StatusCode.UNKNOWN), str(e.get("details", ""))


def read_frame(rfile, max_bytes: int) -> tuple[int, bytes] | None:
    """The next frame from a binary file (``socket.makefile("rb")``) as (kind, payload); None
    at the end of the stream (also mid-frame: the peer went away). Raises ``FrameTooLarge``
    for a payload over ``max_bytes``."""
    head = rfile.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    n, kind = HEADER.unpack(head)
    if n > max_bytes:
        raise FrameTooLarge(f"Received message larger than max ({n} vs. {max_bytes})")
    payload = rfile.read(n) if n else b""
    return None if len(payload) < n else (kind, payload)


class FrameTooLarge(ValueError):
    """A frame's payload is over the receiver's limit (``--max-message-mb``)."""


def add_data_socket_flag(p) -> None:
    """--data-socket of a worker (env ``SPECDEC_DATA_SOCKET`` through ``serving.launch.env_flags``)."""
    p.add_argument("--data-socket", default="",
                   help="also serve the Session stream on this Unix socket path (mode 0600; the data channel: "
                        "an orchestrator on this host sends the per-round messages through it instead of gRPC; "
                        "empty = off); with SPECDEC_DATA_TOKEN set, sessions on it need that bearer token (the "
                        "orchestrator sends its own SPECDEC_DATA_TOKEN)")


class _Aborted(Exception):
    """Unwinds a handler whose session ended (abort, cancel, deadline)."""


class _SocketReader(socket.SocketIO):
    """The connection's raw reader (under its ``io.BufferedReader``), which may poll before it
    sleeps: ``spin`` (None, or () -> seconds) — a read that finds nothing buffered first tries
    non-blocking ``recv``s for that long (the next message of a round usually comes within a
    few hundred µs; polling keeps the thread awake, so it neither sleeps nor has to be woken),
    then blocks as usual. Set once the session is open (``SPECDEC_SPIN_US``: ``spin_settings``)."""
    spin = None

    def readinto(self, b):
        wait = self.spin() if self.spin is not None else 0.0
        if wait > 0:
            until = time.perf_counter() + wait
            while True:
                try:
                    return self._sock.recv_into(b, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if time.perf_counter() >= until:
                        break
                    os.sched_yield()  # (another thread or process that wants this core gets it)
                except OSError:
                    break  # (the blocking read below reports it)
        return super().readinto(b)


class _Conn:
    """One connection: its socket, the single end of its session (``finish``) and the callbacks
    run then."""

    def __init__(self, sock: socket.socket, max_bytes: int, polling: bool = False):
        # a read buffer that holds a whole usual frame (a verify reply's or draft message's features:
        # 4-8 rows of 6.9 KB), so one recv() per frame instead of one per 8 KiB (io's default);
        # ``polling``: the raw reader can busy-poll (``_SocketReader``; the plain one costs 0.3 µs less a read)
        self.raw = (_SocketReader if polling else socket.SocketIO)(sock, "rb")
        self.sock, self.rfile, self.max_bytes = sock, io.BufferedReader(self.raw, READ_BUFFER), max_bytes
        self.send_lock = threading.Lock()  # one frame at a time (held across a send that may block)
        self.end_lock = threading.Lock()  # ``ended`` (never held across I/O)
        self.ended = False
        self.deadline: float | None = None  # time.monotonic()
        self.expired = False  # the monitor ended it at its deadline
        self.callbacks: list = []

    def recv(self) -> tuple[int, bytes] | None:
        try:
            return read_frame(self.rfile, self.max_bytes)
        except OSError:
            return None

    def send(self, kind: int, payload: bytes = b"") -> None:
        """Send one frame; dropped once the session ended (as gRPC drops late replies). Blocks
        while the client does not read (its buffer full) until the session ends."""
        with self.send_lock:
            if self.ended:
                return
            try:
                self.sock.sendall(frame(kind, payload))
            except OSError:  # the peer went away or the monitor shut the socket: the session ends
                pass

    def finish(self, code: grpc.StatusCode | None, details: str = "", send: bool = True, wait: bool = True) -> bool:
        """End the session once: send ``END`` (``code`` None: OK) or ``ERROR`` (unless ``send``
        is False: the peer is gone), then run the callbacks. True if this call ended it.
        ``wait`` False (the monitor): never block; when a send is in progress (the client
        stopped reading) or the frame does not fit in the socket's buffer, the socket is shut
        down instead (the blocked send fails, the client sees the connection close)."""
        with self.end_lock:
            if self.ended:
                return False
            self.ended = True
        if send:
            data = frame(END) if code is None else frame(ERROR, error_payload(code, details))
            if self.send_lock.acquire(blocking=wait):
                try:
                    if wait:
                        self.sock.sendall(data)
                    elif self.sock.send(data, socket.MSG_DONTWAIT) < len(data):
                        self.shutdown()
                except OSError:  # (BlockingIOError: the buffer is full)
                    self.shutdown()
                finally:
                    self.send_lock.release()
            else:
                self.shutdown()
        for fn in self.callbacks:
            try:
                fn()
            except Exception:  # (as gRPC: a failing callback does not stop the others)
                log.exception("data channel end callback failed")
        return True

    def shutdown(self) -> None:
        """Both directions off (a blocked send or read returns); safe from any thread."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.shutdown()
        self.rfile.close()
        self.sock.close()


class _Context:
    """What the servicers use of ``grpc.ServicerContext``, over one connection."""

    def __init__(self, conn: _Conn, metadata: tuple, path: str):
        self.conn, self.metadata, self.path = conn, metadata, path

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self) -> float | None:
        """Seconds to the session's deadline; None without one."""
        return None if self.conn.deadline is None else max(0.0, self.conn.deadline - time.monotonic())

    def is_active(self) -> bool:
        return not self.conn.ended

    def abort(self, code: grpc.StatusCode, details: str):
        """End the session with ``code`` and ``details`` (an ``ERROR`` frame) and unwind the
        handler (raises, as gRPC's ``abort`` does)."""
        self.conn.finish(code, details)
        raise _Aborted(details)

    def add_callback(self, fn) -> bool:
        """``fn()`` once the session ended (on the monitor thread for a cancel or a deadline)."""
        self.conn.callbacks.append(fn)
        return True

    def peer(self) -> str:
        return f"unix:{self.path}"


class DataChannel:
    """Serves ``handler`` (a servicer's ``Session``) over Unix socket ``path`` on ``host``'s
    accounting. ``request_type``: the protobuf message class of one request. ``token``: when
    set, the ``OPEN`` metadata must carry ``authorization: Bearer <token>`` (compared in
    constant time, as ``serving.security.TokenCheck``), else UNAUTHENTICATED. ``max_message_mb``:
    the largest frame accepted (gRPC's ``--max-message-mb``). ``nonce``: this instance's
    identity (hex, random), sent in ``HELLO``; the servicer advertises it in GetInfo.
    ``start()`` binds (OSError naming
    the path: too long, in use by a live process, a directory that does not exist) and returns
    at once; ``close()`` stops accepting and removes the socket file."""

    def __init__(self, host: ServiceHost, handler, request_type, path: str, token: str = "",
                 max_message_mb: int = 64):
        self.host, self.path = host, path
        self.rpcs = {"Session": (handler, wire.tolerant(request_type.FromString))}  # rpc name → (handler, parser)
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_bytes = max_message_mb * 2 ** 20
        self.nonce = secrets.token_hex(16)
        self.conns: dict[int, _Conn] = {}  # by fd, watched by the monitor
        self.opening = 0  # connections waiting for their OPEN (accept thread +1, their thread -1)
        self.opening_lock = threading.Lock()
        self.epoll = select.epoll()
        self.closed = False
        self.context = contextvars.copy_context()  # the log fields bound at start-up (service)
        # busy-polling (SPECDEC_SPIN_US; unset: on for hosts with >= 8 CPUs): a session's thread polls its socket for
        # up to that long before it sleeps in recv, while at most SPECDEC_SPIN_MAX_LIVE sessions are open here
        # (see ``spin_settings``)
        self.spin_s, self.spin_live = spin_settings()

    def add_rpc(self, name: str, handler, request_type) -> None:
        """Also serve ``handler`` (a servicer's stream-stream method) to connections whose ``OPEN``
        names ``rpc`` ``name`` (e.g. "Steps"); ``request_type``: its request message class."""
        self.rpcs[name] = (handler, wire.tolerant(request_type.FromString))

    def _spin(self) -> float:
        return self.spin_s if len(self.conns) <= self.spin_live else 0.0

    def start(self) -> None:
        self.listener = listen_unix(self.path)
        for target, name in ((self._accept, "data-accept"), (self._monitor, "data-monitor")):
            threading.Thread(target=self.context.copy().run, args=(target,), daemon=True, name=name).start()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.listener.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self.opening_lock:
                full = self.opening >= MAX_OPENING
                self.opening += not full
            try:  # (a few bytes into a new connection's empty buffer: never blocks)
                sock.sendall(frame(HELLO, self.nonce.encode()) + (frame(ERROR, error_payload(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_OPENING} data channel connections are waiting for "
                    "their OPEN frame; retry later")) if full else b""))
            except OSError:
                pass
            if full:
                sock.close()
                continue
            threading.Thread(target=self.context.copy().run, args=(self._serve, sock), daemon=True,
                             name="data-session").start()

    def _monitor(self) -> None:
        """End sessions whose peer closed (a cancel) or whose deadline passed."""
        while not self.closed:
            now = time.monotonic()
            soonest = min((c.deadline for c in list(self.conns.values()) if c.deadline is not None and not c.expired),
                          default=now + TICK)
            for fd, _ in self.epoll.poll(min(TICK, max(0.0, soonest - now))):
                conn = self.conns.get(fd)
                if conn is not None and _hung_up(conn.sock):  # (not a new connection that reuses a stale fd)
                    self.conns.pop(fd, None)
                    with contextlib.suppress(OSError):
                        self.epoll.unregister(fd)
                    conn.finish(grpc.StatusCode.CANCELLED, "Cancelled", send=False)
                    conn.shutdown()  # (a send blocked on the closed peer returns)
            now = time.monotonic()
            for conn in [c for c in list(self.conns.values())
                         if c.deadline is not None and c.deadline <= now and not c.expired]:
                conn.expired = True  # handled once: a session whose handler is still inside engine work
                # stays in ``conns`` until it returns, and its past deadline must not make the poll spin
                if conn.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", wait=False):
                    conn.shutdown()  # the handler's blocked read (or send) returns

    def _refusal(self, metadata: tuple, draining_ok: bool = False) -> tuple[grpc.StatusCode, str] | None:
        if self.expected is not None:
            got = dict(metadata).get("authorization", "")
            if not hmac.compare_digest(got.encode(), self.expected):
                return grpc.StatusCode.UNAUTHENTICATED, ("missing bearer token (metadata authorization: Bearer "
                                                         "<token>)" if not got else "wrong bearer token")
        if self.host.draining and not draining_ok:
            return grpc.StatusCode.UNAVAILABLE, DRAINING
        return None

    def _serve(self, sock: socket.socket) -> None:
        conn = _Conn(sock, self.max_bytes, polling=self.spin_s > 0)
        try:
            first = self._first_frame(conn)
            if first is None:
                return
            try:
                metadata, timeout, rpc = parse_open(first)
            except ValueError as e:
                conn.finish(grpc.StatusCode.INVALID_ARGUMENT, f"bad OPEN frame: {e}")
                return
            if rpc not in self.rpcs:
                conn.finish(grpc.StatusCode.UNIMPLEMENTED, f"OPEN names rpc {rpc[:40]!r}; this worker's data channel "
                            f"serves {', '.join(sorted(self.rpcs))}")
                return
            steps = is_steps(rpc)  # (holds no request: no Session slot, not in flight, admitted while draining)
            refused = self._refusal(metadata, draining_ok=steps)
            if refused:
                conn.finish(*refused)
                return
            if timeout is not None and timeout <= 0:  # (gRPC's answer to an expired deadline; the orchestrator's probe)
                conn.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                return
            conn.deadline = None if timeout is None else time.monotonic() + timeout
            if not (self.host.add_steps_stream() if steps else self.host.add_session()):
                conn.finish(grpc.StatusCode.RESOURCE_EXHAUSTED, STEPS_FULL if steps else
                            f"worker has max_sessions {self.host.max_sessions} Session streams open (--max-sessions, "
                            "SPECDEC_MAX_SESSIONS); retry later or on another replica")
                return
            if not steps:
                self.host.add_in_flight(1)
            try:
                self._session(conn, _Context(conn, metadata, self.path), *self.rpcs[rpc])
            finally:
                if steps:
                    self.host.end_steps_stream()
                else:
                    self.host.add_in_flight(-1)
                    self.host.end_session()
        finally:
            if self.conns.pop(sock.fileno(), None) is not None:
                with contextlib.suppress(OSError):
                    self.epoll.unregister(sock.fileno())
            conn.close()

    def _first_frame(self, conn: _Conn) -> bytes | None:
        """The ``OPEN`` frame's payload (within ``OPEN_TIMEOUT`` s); None after ending the
        session (INVALID_ARGUMENT / RESOURCE_EXHAUSTED naming why). Counts as opening until then."""
        try:
            conn.sock.settimeout(OPEN_TIMEOUT)
            first = read_frame(conn.rfile, conn.max_bytes)
        except FrameTooLarge as e:
            conn.finish(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            return None
        except TimeoutError:
            conn.finish(grpc.StatusCode.INVALID_ARGUMENT, f"no OPEN frame within {OPEN_TIMEOUT:g} s")
            return None
        except OSError:
            first = None
        finally:
            with self.opening_lock:
                self.opening -= 1
            with contextlib.suppress(OSError):
                conn.sock.settimeout(None)
        if first is None or first[0] != OPEN:
            conn.finish(grpc.StatusCode.INVALID_ARGUMENT, "a data channel connection starts with an OPEN frame")
            return None
        return first[1]

    def _session(self, conn: _Conn, context: _Context, handler, parse) -> None:
        if self.spin_s > 0:
            conn.raw.spin = self._spin
        self.conns[conn.sock.fileno()] = conn
        self.epoll.register(conn.sock.fileno(), select.EPOLLHUP | select.EPOLLERR)  # (not IN: the handler reads)
        try:
            requests = _checked_sync(self._requests(conn, context, parse), context)
            with contextlib.closing(handler(requests, context)) as replies:
                for reply in replies:
                    if self.host.grace_over:
                        context.abort(grpc.StatusCode.UNAVAILABLE, GRACE_OVER)
                    conn.send(MESSAGE, reply.SerializeToString())
                    if conn.ended:
                        break
            conn.finish(None)
        except _Aborted:
            pass
        except Exception as e:  # a servicer bug: UNKNOWN, as gRPC reports an exception in a handler
            log.exception("data channel session failed")
            conn.finish(grpc.StatusCode.UNKNOWN, f"Exception calling application: {e}")

    def _requests(self, conn: _Conn, context: _Context, parse):
        """The session's request messages until ``END``; a close without it (or any end of the
        session meanwhile) unwinds the handler as a cancelled RPC."""
        while True:
            try:
                got = conn.recv()
            except FrameTooLarge as e:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            if got is None or conn.ended:
                conn.finish(grpc.StatusCode.CANCELLED, "Cancelled", send=False)
                raise _Aborted("the client closed the data socket")
            if got[0] == MESSAGE:
                yield parse(got[1])
            elif got[0] == END:
                return
            else:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected frame kind {got[0]} in a session (after "
                              f"OPEN a client sends MESSAGE frames ({MESSAGE}) and one END ({END}))")


def parse_open(payload: bytes) -> tuple[tuple, float | None, str]:
    """(metadata, timeout in seconds or None, rpc name) of an ``OPEN`` frame; ValueError naming
    the field (also for JSON too deep or a number too large to read)."""
    try:
        head = json.loads(payload)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except ValueError as e:  # (also bad UTF-8)
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(head, dict):
        raise ValueError("not a JSON object")
    pairs = head.get("metadata", [])
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ValueError("metadata must be a list of [key, value] pairs")
    timeout = head.get("timeout")
    if timeout is not None:
        try:
            timeout = float(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else None
        except OverflowError:
            timeout = None
        if timeout is None or not math.isfinite(timeout):
            raise ValueError(f"timeout must be a finite number of seconds or null, got {str(head['timeout'])[:40]}")
    rpc = head.get("rpc", "Session")
    if not isinstance(rpc, str):
        raise ValueError("rpc must be a string (Session or Steps)")
    return tuple((str(k), str(v)) for k, v in pairs), timeout, rpc


def _hung_up(sock: socket.socket) -> bool:
    """True when the peer closed ``sock`` (POLLHUP / POLLERR now; poll with no events asked
    reports only those)."""
    p = select.poll()
    try:
        p.register(sock.fileno(), 0)
    except (ValueError, OSError):  # closed meanwhile
        return False
    return bool(p.poll(0))


def listen_unix(path: str) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0600 before it accepts anyone. A stale socket
    file (no process answers it) is replaced; OSError naming the path otherwise."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise OSError(f"--data-socket {path}: exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(path) == 0:
                raise OSError(f"--data-socket {path}: another process serves it")
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(path)
        os.chmod(path, 0o600)  # before listen(): nobody can connect in between
        s.listen(512)
    except OSError as e:
        s.close()
        raise OSError(f"--data-socket {path}: {e.strerror or e}") from None
    return s


def serve_data_channel(config, host: ServiceHost, state: dict) -> DataChannel | None:
    """The worker's data channel when its flags set ``--data-socket`` (None otherwise): the
    servicer and request class its role's ``register`` left in ``state["session"]`` (and the
    ``Steps`` request class in ``state["steps"]``, when it serves one); started,
    its path and nonce advertised by the servicer's ``data_socket`` / ``data_nonce`` (GetInfo). Requires a bearer token
    when ``SPECDEC_DATA_TOKEN`` is set (the orchestrator sends the same variable's value).
    OSError naming the path when it cannot listen."""
    path = getattr(config, "data_socket", "")
    if not path or "session" not in state:
        return None
    servicer, request_type = state["session"]
    channel = DataChannel(host, servicer.Session, request_type, os.path.abspath(path), env_default("data_token", ""),
                          getattr(config, "max_message_mb", 64))
    if "steps" in state:
        channel.add_rpc("Steps", servicer.Steps, state["steps"])
    channel.start()
    servicer.data_socket, servicer.data_nonce = channel.path, channel.nonce
    log.info("data socket serving", path=channel.path, **busy_poll_fields())
    return channel
