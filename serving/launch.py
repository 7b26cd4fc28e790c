"""One start-up path for the three services: ``launch(role, config)``.

``python -m target_service | draft_service | orchestrator`` parse their flags (each flag also
reads ``SPECDEC_<FLAG>``) into ``config`` and call ``launch`` with their ``Role``: JSON logs
named after the role, one gRPC host with health (liveness ``""`` SERVING while up; readiness,
the service's name, NOT_SERVING until warm and while draining) and reflection, listen
(``--host``/``--port``, or ``--host unix:///path`` for a unix socket),
/metrics on ``--metrics-port``, the role's ``prepare`` (connect, check), its blocking
``load_and_warm`` on the engine thread, an optional async warm-up round, SERVING, the role's
``follow`` task, and on SIGINT/SIGTERM a drain of up to ``--drain-seconds``.
"""
from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

from serving import security
from serving.logs import configure
from serving.metrics import serve_metrics
from serving.server import ServiceHost, serve_forever


@dataclass(frozen=True)
class Role:
    """name: the logs' ``service`` field; service: the full gRPC service name (health,
    reflection); register(host, state): add the servicer (before the server starts; ``state``
    is the dict the servicer reads its engine or workers from); prepare(config, host, state,
    log): async, after listening; returns (load_and_warm, warm_async or None); follow(host,
    state, log): optional, runs from SERVING until the stop (the orchestrator's readiness
    follows its workers)."""

    name: str
    service: str
    register: Callable[[ServiceHost, dict], None]
    prepare: Callable[..., Awaitable[tuple[Callable[[], None], Callable[[], Awaitable[None]] | None]]]
    follow: Callable[[ServiceHost, dict, object], Awaitable[None]] | None = None  # runs while serving (may change readiness)


async def serve(role: Role, config: argparse.Namespace) -> None:
    log = configure(role.name, config.log_level)
    host = ServiceHost([role.service], config.max_message_mb, interceptors=security.server_interceptors(config))
    state: dict = {}
    role.register(host, state)
    port = await host.start(listen_address(config.host, config.port), security.server_credentials_from(config))
    log.info("listening", port=port, metrics_port=serve_metrics(config.metrics_port))
    load_and_warm, warm_async = await role.prepare(config, host, state, log)
    follow = (lambda: role.follow(host, state, log)) if role.follow else None
    await serve_forever(host, log, load_and_warm, warm_async, config.drain_seconds, follow)


def listen_address(host: str, port: int) -> str:
    """``host:port``, or ``host`` itself when it is a unix socket address (``unix:///path`` or
    ``unix:path``: workers on the orchestrator's machine skip TCP; the orchestrator's
    ``--target``/``--draft`` take the same address)."""
    return host if host.startswith("unix:") else f"{host}:{port}"


def launch(role: Role, config: argparse.Namespace) -> None:
    """Run the service until SIGINT/SIGTERM."""
    asyncio.run(serve(role, config))
