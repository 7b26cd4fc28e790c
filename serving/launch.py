"""One start-up path for the three services: ``launch(role, config)``.

``python -m target_service | draft_service | orchestrator`` parse their flags (each flag also
reads ``SPECDEC_<FLAG>``) into ``config`` and call ``launch`` with their ``Role``: JSON logs
named after the role, one gRPC host with health (NOT_SERVING until warm) and reflection,
listen, the role's ``prepare`` (connect, check), its blocking ``load_and_warm`` on the engine
thread, an optional async warm-up round, SERVING, graceful stop on SIGINT/SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable

from serving.logs import configure
from serving.server import ServiceHost, serve_forever


@dataclass(frozen=True)
class Role:
    """name: the logs' ``service`` field; service: the full gRPC service name (health,
    reflection); register(host, state): add the servicer (before the server starts; ``state``
    is the dict the servicer reads its engine or workers from); prepare(config, host, state,
    log): async, after listening; returns (load_and_warm, warm_async or None)."""

    name: str
    service: str
    register: Callable[[ServiceHost, dict], None]
    prepare: Callable[..., Awaitable[tuple[Callable[[], None], Callable[[], Awaitable[None]] | None]]]


async def serve(role: Role, config: argparse.Namespace) -> None:
    log = configure(role.name, config.log_level)
    host = ServiceHost([role.service], config.max_message_mb)
    state: dict = {}
    role.register(host, state)
    port = await host.start(f"{config.host}:{config.port}")
    log.info("listening", port=port)
    load_and_warm, warm_async = await role.prepare(config, host, state, log)
    await serve_forever(host, log, load_and_warm, warm_async)


def launch(role: Role, config: argparse.Namespace) -> None:
    """Run the service until SIGINT/SIGTERM."""
    asyncio.run(serve(role, config))
