"""gRPC server construction: message limits, health (grpc.health.v1), reflection, the engine
thread. (Engine errors → status codes: ``protocol.wire``.)"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protocol import wire


def channel_options(max_message_mb: int) -> list[tuple[str, int]]:
    n = max_message_mb * 2 ** 20
    return [("grpc.max_send_message_length", n), ("grpc.max_receive_message_length", n)]


#: Server side of the orchestrator's keepalive pings (``orchestrator.workers``): accept them at
#: any rate, also during a long forward that sends no data (gRPC's default answers them with
#: GOAWAY "too_many_pings", ending the streams in flight).
ACCEPT_PINGS = [("grpc.http2.max_ping_strikes", 0)]


_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_ALWAYS_ANSWERED = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # also while draining
DRAINING = "server is shutting down (draining); retry on another replica"
GRACE_OVER = "server shut down: the drain grace period ran out"


class ServiceHost:
    """An aio server with health + reflection, and one engine thread for blocking model work.

    Health (grpc.health.v1): ``""`` is liveness — SERVING from ``start()`` while the process
    answers; each service's full name is readiness — NOT_SERVING while loading, capturing graphs
    and warming up, SERVING after ``set_status(True)``, NOT_SERVING again while draining.
    Every RPC except health and reflection is counted while in flight (``in_flight``); once
    ``drain()`` began new ones are refused with UNAVAILABLE, and when its grace period ran out
    the streams still open end with UNAVAILABLE at their next message.
    """

    def __init__(self, service_names: list[str], max_message_mb: int = 64, interceptors=()):
        self.draining = False
        self.grace_over = False
        self.in_flight = 0
        self.server = grpc.aio.server(options=channel_options(max_message_mb) + ACCEPT_PINGS,
                                      interceptors=[_Drain(self), *interceptors])  # (+ serving.security's token check)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.server)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engine_busy = 0  # run_engine calls queued or running on the engine thread

    async def set_status(self, serving: bool) -> None:
        """Readiness of every service name (never SERVING while draining)."""
        status = _SERVING if serving and not self.draining else _NOT_SERVING
        for name in self.service_names:
            await self.health.set(name, status)

    async def fail(self) -> None:
        """The process can no longer serve (e.g. a tensor-parallel rank died): liveness and
        readiness both NOT_SERVING, so a supervisor (Kubernetes' liveness probe) restarts it."""
        await self.health.set("", _NOT_SERVING)
        await self.set_status(False)

    async def start(self, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
        """Bind (port 0 = any free port; TLS with ``credentials``, ``serving.security``), start
        live but not ready; returns the bound port."""
        port = (self.server.add_secure_port(address, credentials) if credentials
                else self.server.add_insecure_port(address))
        if port == 0:
            raise RuntimeError(f"could not bind {address}")
        await self.health.set("", _SERVING)
        await self.set_status(False)
        await self.server.start()
        return port

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

    async def run_engine(self, fn, *args, inline: bool = False):
        """Run blocking engine work on the engine thread. ``inline``: when no engine work is
        queued or running there, call ``fn`` on the event loop instead — for per-round calls
        (verify, draft: ~1 ms on a GPU) the thread hop costs more than the call (submit, wake-up,
        GIL hand-over, ``call_soon_threadsafe``: ~0.1–0.3 ms per call, plans/0004). The loop
        answers nothing else meanwhile (health, other sessions' messages wait ≤ one call);
        long calls (prefill, load) must stay off the loop."""
        if inline and not self.engine_busy:
            return fn(*args)
        self.engine_busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.engine_busy -= 1


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
    host.executor.shutdown(wait=False, cancel_futures=True)
    log.info("stopped")
