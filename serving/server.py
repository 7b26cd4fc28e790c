"""gRPC server construction: message limits, health (grpc.health.v1), reflection, drain, and
how engine calls run. (Engine errors → status codes: ``protocol.wire``.)

The workers (``THREADED_SERVICES``) run on gRPC's thread-per-RPC server: a Session stream's
handler thread reads a message and yields the reply — no event-loop hand-off per message
(plans/0004 "Measured"). A prefill it runs itself (the engine's locks order its chunks against
other work); its rounds' verify and draft messages it hands to the host's ``StepBatcher``
(``serving.batcher``), which runs the messages of all streams queued meanwhile as one engine
call (issue 14). The orchestrator, a client of both workers in its round loop, runs
on grpc.aio.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protocol import wire
from serving.batcher import MAX_WAIT_S, Closed, Skipped, StepBatcher
from serving.shards import shard


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    n = max_message_mb * 2 ** 20
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


#: Server side of the orchestrator's keepalive pings (``orchestrator.workers``): accept them at
#: any rate, also during a long forward that sends no data (gRPC's default answers them with
#: GOAWAY "too_many_pings", ending the streams in flight).
ACCEPT_PINGS = [("grpc.http2.max_ping_strikes", 0)]

#: A port is one service's: gRPC sets SO_REUSEPORT by default, so a second process could bind a
#: port already in use and the kernel would split new connections between the two.
EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]
#: ... except between the shards of one orchestrator (``serving.shards``: its supervisor checked
#: the port was free and started them): they share it on purpose.
SHARED_PORT = [("grpc.so_reuseport", 1)]


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_ALWAYS_ANSWERED = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # also while draining
DRAINING = "server is shutting down (draining); retry on another replica"
GRACE_OVER = "server shut down: the drain grace period ran out"
#: served by gRPC's thread-per-RPC server (everything else on grpc.aio): the workers
THREADED_SERVICES = frozenset({"specdec.v2.TargetService", "specdec.v2.DraftService"})


#: default of ``--max-batch`` (SPECDEC_MAX_BATCH): most verify / draft messages per engine call
MAX_BATCH = 64


def session_threads() -> int:
    """Handler threads of a threaded host (``SPECDEC_SESSION_THREADS``, default 512): an open
    Session stream holds one for its life, a health check or GetInfo one per call; RPCs beyond
    that are refused with RESOURCE_EXHAUSTED rather than queued unanswered."""
    return env_default("session_threads", 512)


#: RPC slots of a threaded host kept free of Session streams by default (``max_sessions``): health
#: checks, GetInfo and reflection stay answerable however many sessions are open or waiting
SESSION_RESERVE = 16


#: ``Steps`` streams a worker serves at once (one per orchestrator process: ``serving.steps``); they
#: take handler threads of their own (added to the pool), not Session slots
MAX_STEPS_STREAMS = 16
STEPS_FULL = (f"worker has {MAX_STEPS_STREAMS} Steps streams open (one per orchestrator process; MAX_STEPS_STREAMS); "
              "run fewer orchestrator processes per worker, or --steps off")


def is_steps(method: str) -> bool:
    """``method`` (a gRPC method path, or the data channel's rpc name) is a ``Steps`` stream."""
    return method == "Steps" or method.endswith("/Steps")


def max_sessions() -> int:
    """Default of ``--max-sessions`` (``SPECDEC_MAX_SESSIONS``): the most Session streams a worker
    serves at once, ``session_threads()`` less a reserve of ``SESSION_RESERVE`` slots (a quarter
    of them when fewer than 64); beyond it a new Session is refused at once with
    RESOURCE_EXHAUSTED naming the limit."""
    threads = session_threads()
    return env_default("max_sessions", max(1, threads - min(SESSION_RESERVE, max(1, threads // 4))))


class ServiceHost:
    """A gRPC server with health + reflection and the drain, and the engine lock.

    ``threads``: handler threads of gRPC's sync (thread-per-RPC) server, or 0 for grpc.aio (one
    event loop). Default: ``session_threads()`` when every service is a worker
    (``THREADED_SERVICES``), else 0. A worker's handler sends its rounds' messages through a
    ``batcher`` (verify, draft: one batch at a time per batcher, up to ``max_batch`` messages) and calls the engine's thread-safe methods (prefill, release) itself;
    ``call_engine`` runs one call at a time under ``engine_lock`` and ``run_engine`` awaits it
    from a coroutine on the ``executor`` thread (load and warm-up).

    Health (grpc.health.v1): ``""`` is liveness — SERVING from ``start()`` while the process
    answers; each service's full name is readiness — NOT_SERVING while loading, capturing graphs
    and warming up, SERVING after ``set_status(True)``, NOT_SERVING again while draining.
    Every RPC except health and reflection is counted while in flight (``in_flight``); once
    ``drain()`` began new ones are refused with UNAVAILABLE, and when its grace period ran out
    the streams still open end with UNAVAILABLE at their next message. A threaded host serves
    at most ``max_sessions`` streams at once (``sessions``; more: RESOURCE_EXHAUSTED naming the
    limit), below its ``threads`` RPC slots, so health and GetInfo always find a slot.
    """

    def __init__(self, service_names: list[str], max_message_mb: int = 64, threads: int | None = None,
                 interceptors=()):
        self.draining = False
        self.grace_over = False
        self.in_flight = 0
        self.sessions = 0  # open streams of a threaded host
        self.steps_streams = 0  # open Steps streams (not sessions: they hold no request)
        self._count = threading.Lock()  # in_flight and sessions, changed from handler threads
        self.service_names = list(service_names)
        if threads is None:
            threads = session_threads() if service_names and set(service_names) <= THREADED_SERVICES else 0
        self.threads = threads
        self.max_sessions = min(max_sessions(), max(1, threads - 1)) if threads else 0
        options = channel_options(max_message_mb) + ACCEPT_PINGS + (SHARED_PORT if shard() else EXCLUSIVE_PORT)
        if threads:
            if any(isinstance(i, grpc.aio.ServerInterceptor) for i in interceptors):
                raise TypeError("a threaded (worker) host takes grpc.ServerInterceptor interceptors, not grpc.aio ones")
            pool = threads + MAX_STEPS_STREAMS  # (Steps streams take threads of their own: never a Session's slot)
            server = grpc.server(ThreadPoolExecutor(pool, thread_name_prefix="rpc"), options=options,
                                 interceptors=[_SyncDrain(self), *interceptors], maximum_concurrent_rpcs=pool)
            self.server = _Threaded(server)
            self.health = health.HealthServicer()
            self._ends = ThreadPoolExecutor(max_workers=1, thread_name_prefix="release")  # on_end's calls
        else:
            server = self.server = grpc.aio.server(  # + the bearer-token check (serving.security)
                options=options, interceptors=[_Drain(self), *interceptors])
            self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], server)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engine_lock = threading.Lock()  # one call_engine at a time (load, warm-up)
        self.batchers: list[StepBatcher] = []
        self.max_batch, self.batch_wait_s = env_default("max_batch", MAX_BATCH), env_default("batch_wait_us", 0) / 1e6

    async def _set_health(self, name: str, status) -> None:
        done = self.health.set(name, status)  # a coroutine on aio, a plain call on the sync servicer
        if inspect.isawaitable(done):
            await done

    async def set_status(self, serving: bool) -> None:
        """Readiness of every service name (never SERVING while draining)."""
        status = _SERVING if serving and not self.draining else _NOT_SERVING
        for name in self.service_names:
            await self._set_health(name, status)

    async def fail(self) -> None:
        """The process can no longer serve (e.g. a tensor-parallel rank died): liveness and
        readiness both NOT_SERVING, so a supervisor (Kubernetes' liveness probe) restarts it."""
        await self._set_health("", _NOT_SERVING)
        await self.set_status(False)

    async def start(self, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
        """Bind ``host:port`` (port 0 = any free port) or ``unix:///path`` (a unix socket: workers
        on the orchestrator's machine), start live but not ready; returns the bound port (1 for
        a unix socket). TLS with ``credentials`` (``serving.security``)."""
        port = (self.server.add_secure_port(address, credentials) if credentials
                else self.server.add_insecure_port(address))
        if port == 0:
            raise RuntimeError(f"could not bind {address}")
        await self._set_health("", _SERVING)
        await self.set_status(False)
        await self.server.start()
        return port

    def add_in_flight(self, n: int) -> None:
        with self._count:
            self.in_flight += n

    def add_session(self) -> bool:
        """Count a new stream in; False (not counted) when ``max_sessions`` are open."""
        with self._count:
            if self.sessions >= self.max_sessions:
                return False
            self.sessions += 1
            return True

    def end_session(self) -> None:
        with self._count:
            self.sessions -= 1

    def add_steps_stream(self) -> bool:
        """Count a new ``Steps`` stream in; False when ``MAX_STEPS_STREAMS`` are open. A Steps
        stream holds no request, so it takes no Session slot, is not in flight (a drain does not
        wait for it) and is admitted while draining: the rounds of requests admitted before the
        drain must go on to their end."""
        with self._count:
            if self.steps_streams >= MAX_STEPS_STREAMS:
                return False
            self.steps_streams += 1
            return True

    def end_steps_stream(self) -> None:
        with self._count:
            self.steps_streams -= 1

    async def drain(self, seconds: float, log) -> None:
        """Readiness NOT_SERVING, refuse new requests, wait up to ``seconds`` for the in-flight
        ones; then end those still open (their next message gets UNAVAILABLE)."""
        self.draining = True
        await self.set_status(False)
        log.info("draining", in_flight=self.in_flight, grace_seconds=seconds)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("grace period over: ending requests", in_flight=self.in_flight)
            self.grace_over = True
            deadline = loop.time() + 2.0
            while self.in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)

    def call_engine(self, fn, *args):
        """``fn(*args)`` in the calling (handler) thread, one engine call at a time."""
        with self.engine_lock:
            return fn(*args)

    def batcher(self, run_batch, name: str, on_batch=None, expected=None, key=None) -> StepBatcher:
        """A ``StepBatcher`` over ``run_batch`` (items → results | exceptions) with this host's
        ``max_batch`` and ``batch_wait_s`` (``expected``: live requests, ``key``: an item's request
        id, see StepBatcher), stopped by ``close``."""
        b = StepBatcher(run_batch, self.max_batch, self.batch_wait_s, name=name, on_batch=on_batch, expected=expected,
                        key=key)
        self.batchers.append(b)
        return b

    def set_batching(self, max_batch: int, wait_s: float = 0.0, max_sessions: int | None = None) -> None:
        """Every batcher's most messages per engine call (``--max-batch``; 1 = one at a time)
        and gather window (``--batch-wait-us``; 0 = none), and the host's ``max_sessions``
        (``--max-sessions``; None: unchanged)."""
        self.max_batch, self.batch_wait_s = max_batch, wait_s
        if max_sessions is not None:
            self.max_sessions = max_sessions
        for b in self.batchers:
            b.max_batch, b.wait_s = max_batch, wait_s

    async def run_engine(self, fn, *args):
        """``call_engine`` on the engine thread, awaited: blocking engine work from a coroutine
        (load and warm-up)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.call_engine, fn, *args)

    def on_end(self, context: grpc.ServicerContext, fn) -> "Once":
        """``fn`` (a release) run once: by the returned ``Once`` (the handler's ``finally``), or
        as soon as the RPC ends — cancelled, past its deadline, the client gone — on a background
        thread, whichever comes first; so the release reaches the engine while the handler thread
        is still inside an engine call (a prefill stops at its next chunk boundary). Threaded
        hosts only."""
        once = Once(fn)
        context.add_callback(lambda: self._ends.submit(once))
        return once

    def close(self) -> None:
        """Stop the engine (and release) threads without waiting; messages still queued for a
        batch fail with UNAVAILABLE (the running batches finish)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        for b in self.batchers:
            b.close(timeout=0)
        if self.threads:
            self._ends.shutdown(wait=False)


class Once:
    """Calls ``fn`` on its first call only (thread-safe). While ``armed`` is False calls do
    nothing (and do not count)."""

    def __init__(self, fn):
        self.fn, self.armed, self.done, self._lock = fn, True, False, threading.Lock()

    def __call__(self) -> bool:
        """True if this call ran ``fn``."""
        with self._lock:
            if self.done or not self.armed:
                return False
            self.done = True
        self.fn()
        return True


class _Threaded:
    """gRPC's sync server with the aio server's awaitable ``start``/``stop`` (what ``ServiceHost``,
    ``serve_forever`` and in-process test servers call); the rest is the wrapped ``grpc.Server``."""

    def __init__(self, server: grpc.Server):
        self.wrapped = server

    def __getattr__(self, name):
        return getattr(self.wrapped, name)

    async def start(self) -> None:
        self.wrapped.start()

    async def stop(self, grace: float | None) -> None:
        await asyncio.to_thread(lambda: self.wrapped.stop(grace).wait())


@contextlib.contextmanager
def engine_errors(context: grpc.ServicerContext):
    """``with engine_errors(context): ...`` in a sync handler: an engine error aborts the RPC
    with its status (``protocol.wire.STATUS``, message kept), a batcher that closed with
    UNAVAILABLE, a message skipped because its RPC had ended with CANCELLED; anything else
    propagates."""
    try:
        yield
    except (*wire.STATUS, Closed, Skipped) as e:
        context.abort(*status_of(e))


def status_of(e: Exception) -> tuple[grpc.StatusCode, str]:
    """(gRPC status, details) an engine error ends a call with: ``protocol.wire.STATUS``'s code
    for engine errors, UNAVAILABLE for a closed batcher, CANCELLED for an item skipped because
    its call had ended, UNKNOWN (naming the exception type) for anything else."""
    for cls, code in wire.STATUS.items():
        if isinstance(e, cls):
            return code, str(e)
    if isinstance(e, Closed):
        return grpc.StatusCode.UNAVAILABLE, str(e)
    if isinstance(e, Skipped):
        return grpc.StatusCode.CANCELLED, str(e)
    return grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"


def _checked_sync(request, context: grpc.ServicerContext):
    """``wire.checked`` for sync handlers: the request (a message, or an iterator of messages)
    with every ``wire.Undecodable`` refused with INVALID_ARGUMENT."""
    if isinstance(request, wire.Undecodable):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
    if not hasattr(request, "__next__"):
        return request

    def messages():
        for msg in request:
            if isinstance(msg, wire.Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg.details)
            yield msg
    return messages()


class _Drain(grpc.aio.ServerInterceptor):
    """Counts in-flight RPCs on the host, refuses new ones while it drains and ends open
    streams once the grace period ran out (health and reflection always pass)."""

    def __init__(self, host: ServiceHost):
        self.host = host

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_ALWAYS_ANSWERED):
            return handler
        host = self.host

        async def admit(context):
            if host.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
            host.in_flight += 1

        async def stream(behavior, request, context):
            await admit(context)
            try:
                request = await wire.checked(request, context)  # an unparsable message: INVALID_ARGUMENT
                async for reply in behavior(request, context):
                    if host.grace_over:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, GRACE_OVER)
                    yield reply
            finally:
                host.in_flight -= 1

        async def unary(behavior, request, context):
            await admit(context)
            try:
                request = await wire.checked(request, context)
                return await behavior(request, context)
            finally:
                host.in_flight -= 1

        return _wrapped(handler, unary, stream)


class _SyncDrain(grpc.ServerInterceptor):
    """``_Drain`` for the threaded server (handlers are plain functions and generators)."""

    def __init__(self, host: ServiceHost):
        self.host = host

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or details.method.startswith(_ALWAYS_ANSWERED):
            return handler
        host = self.host

        def admit(context):
            if host.draining:
                context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING)
            host.add_in_flight(1)

        def steps_stream(behavior, request, context):
            if not host.add_steps_stream():
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, STEPS_FULL)
            try:
                with contextlib.closing(behavior(_checked_sync(request, context), context)) as replies:
                    yield from replies
            finally:
                host.end_steps_stream()

        def stream(behavior, request, context):
            if not host.add_session():  # the RPC slots above max_sessions stay free for health, GetInfo
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"worker has max_sessions {host.max_sessions} Session streams open (--max-sessions, "
                              "SPECDEC_MAX_SESSIONS); retry later or on another replica")
            try:
                admit(context)
                try:
                    with contextlib.closing(behavior(_checked_sync(request, context), context)) as replies:
                        for reply in replies:
                            if host.grace_over:
                                context.abort(grpc.StatusCode.UNAVAILABLE, GRACE_OVER)
                            yield reply
                finally:
                    host.add_in_flight(-1)
            finally:
                host.end_session()

        def unary(behavior, request, context):
            admit(context)
            try:
                return behavior(_checked_sync(request, context), context)
            finally:
                host.add_in_flight(-1)

        return _wrapped(handler, unary, steps_stream if is_steps(details.method) else stream)


def _wrapped(handler, unary, stream):
    """``handler`` with its behavior wrapped by ``unary`` or ``stream`` (behavior, request,
    context) and a request deserializer that turns an unparsable message into ``Undecodable``."""
    codec = dict(request_deserializer=wire.tolerant(handler.request_deserializer),
                 response_serializer=handler.response_serializer)
    for kind, wrap, make in (("unary_unary", unary, grpc.unary_unary_rpc_method_handler),
                             ("stream_unary", unary, grpc.stream_unary_rpc_method_handler),
                             ("unary_stream", stream, grpc.unary_stream_rpc_method_handler),
                             ("stream_stream", stream, grpc.stream_stream_rpc_method_handler)):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return make(functools.partial(wrap, behavior), **codec)
    return handler


def env_default(name: str, default):
    """Value of environment variable SPECDEC_<NAME> (typed like ``default``), else ``default``."""
    import os

    raw = os.environ.get(f"SPECDEC_{name.upper()}")
    if raw is None:
        return default
    if isinstance(default, bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return type(default)(raw) if default is not None else raw


def add_operation_flags(p) -> None:
    """--metrics-port and --drain-seconds, shared by the three services."""
    p.add_argument("--metrics-port", type=int, default=env_default("metrics_port", 0),
                   help="serve Prometheus /metrics over HTTP on this port (0 = off)")
    p.add_argument("--drain-seconds", type=float, default=env_default("drain_seconds", 30.0),
                   help="on SIGTERM: readiness NOT_SERVING, new requests refused with UNAVAILABLE, in-flight "
                        "ones get this long to finish before they end with UNAVAILABLE")
    from serving.security import add_server_flags

    add_server_flags(p)  # --tls-cert, --tls-key, --tls-client-ca


def add_batching_flags(p, what: str) -> None:
    """--max-batch, --batch-wait-us and --max-sessions of a worker whose batched messages are
    ``what`` (verify, draft); applied by ``ServiceHost.set_batching``. Lower bounds for
    ``serving.launch.parse_checked``: ``BATCHING_BOUNDS``; upper ones: ``check_batching``."""
    p.add_argument("--max-batch", type=int, default=MAX_BATCH,
                   help=f"most {what} messages (one per request) run as one engine call; messages that arrive "
                        "while a call runs form the next one (1: one request at a time)")
    p.add_argument("--batch-wait-us", type=int, default=0,
                   help="microseconds a batch that is not full waits for more messages before its engine call "
                        f"(0: none; the batch is what queued while the previous call ran; at most "
                        f"{int(MAX_WAIT_S * 1e6)}); the wait ends once every request that sent in the last "
                        "batches has sent")
    p.add_argument("--max-sessions", type=int, default=max_sessions(),
                   help="most Session streams (requests, including opens waiting for KV) served at once; more are "
                        "refused with RESOURCE_EXHAUSTED; below SPECDEC_SESSION_THREADS so health checks and "
                        "GetInfo always get through")


BATCHING_BOUNDS = {"--max-batch": 1, "--batch-wait-us": 0, "--max-sessions": 1}


def check_batching(p, args):
    """Upper bounds of the batching flags (after ``parse_checked``): --batch-wait-us ≤ MAX_WAIT_S
    in µs, --max-sessions < SPECDEC_SESSION_THREADS; otherwise exit 2 with a usage error naming
    the flag, the bound and the value. Returns ``args``."""
    for flag, value, high in (("--batch-wait-us", args.batch_wait_us, int(MAX_WAIT_S * 1e6)),
                              ("--max-sessions", args.max_sessions, session_threads() - 1)):
        if value > high:
            p.error(f"{flag} must be <= {high} (got {value})")
    return args


def pick_device(name: str, dtype: str = "auto"):
    """'auto' → cuda if available else cpu. Returns (torch.device, compute dtype); dtype
    'auto' = float32 on CPU, bfloat16 on GPU, else 'bfloat16' | 'float16' | 'float32'.
    Raises ValueError for another dtype name."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if dtype == "auto":
        return device, (torch.float32 if device.type == "cpu" else torch.bfloat16)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"--dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
    return device, getattr(torch, dtype)


async def serve_forever(host: ServiceHost, log, load_and_warm, warm_async=None, drain_seconds: float = 30.0,
                        follow=None) -> None:
    """Run ``load_and_warm()`` (blocking) on the engine thread and ``await warm_async()`` if
    given, then report ready (and run ``follow()``, a task that may change readiness, until the
    stop) and serve until SIGINT/SIGTERM: then drain for up to ``drain_seconds``: readiness
    NOT_SERVING, new requests refused, in-flight ones finish; what is left ends with
    UNAVAILABLE; the server stops."""
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await host.run_engine(load_and_warm)
    if warm_async is not None:
        await warm_async()
    await host.set_status(True)
    log.info("serving")
    follower = asyncio.create_task(follow()) if follow else None
    await stop.wait()
    if follower:
        follower.cancel()
    await host.drain(drain_seconds, log)
    await host.server.stop(grace=None)
    host.close()
    log.info("stopped")
