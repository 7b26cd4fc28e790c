"""One start-up path for the three services: ``launch(role, config)``.

``python -m target_service | draft_service | orchestrator`` parse their flags into ``config``
(``parser`` + ``env_flags``: each flag's default comes from an environment variable, named in
``--help``) and call ``launch`` with their ``Role``: JSON logs
named after the role, one gRPC host with health (liveness ``""`` SERVING while up; readiness,
the service's name, NOT_SERVING until warm and while draining) and reflection, listen
(``--host``/``--port``, or ``--host unix:///path`` for a unix socket), a worker's data channel
(``--data-socket``, ``serving.datachannel``), /metrics on ``--metrics-port``, the role's ``prepare`` (connect, check), its blocking
``load_and_warm`` on the engine thread, an optional async warm-up round, SERVING, the role's
``follow`` task, and on SIGINT/SIGTERM a drain of up to ``--drain-seconds``. A ``prepare``
that raises ``StartupError`` (a worker never ready, a drafter that does not fit) logs one error
line and the process exits 1.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from typing import Awaitable, Callable

from serving import security
from serving.datachannel import serve_data_channel
from serving.logs import configure
from serving.metrics import serve_metrics
from serving.server import ServiceHost, env_default, serve_forever


class StartupError(Exception):
    """The service cannot start (its message says why, for one log line); exit status 1."""


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


async def serve(role: Role, config: argparse.Namespace) -> int:
    """Run the service until the stop; returns the exit status (0, or 1 after a StartupError)."""
    log = configure(role.name, config.log_level)
    try:
        credentials = security.server_credentials_from(config)
    except security.CredentialsError as e:
        log.error(str(e))
        return 1
    host = ServiceHost([role.service], config.max_message_mb, interceptors=security.server_interceptors(config))
    state: dict = {}
    role.register(host, state)
    port = await host.start(listen_address(config.host, config.port), credentials)
    try:
        data = serve_data_channel(config, host, state)
    except OSError as e:
        log.error(str(e))
        await host.server.stop(grace=None)
        host.close()
        return 1
    log.info("listening", port=port, metrics_port=serve_metrics(config.metrics_port),
             **({"data_socket": data.path} if data else {}))
    try:
        load_and_warm, warm_async = await role.prepare(config, host, state, log)
        follow = (lambda: role.follow(host, state, log)) if role.follow else None
        await serve_forever(host, log, load_and_warm, warm_async, config.drain_seconds, follow)
    except (StartupError, security.CredentialsError) as e:  # the latter: the worker links' TLS files
        log.error(str(e))
        return 1
    finally:  # also after an error: a server left running warns "Event loop is closed" at exit
        if data:
            data.close()
        await host.server.stop(grace=None)
        host.close()
    return 0


def listen_address(host: str, port: int) -> str:
    """``host:port``, or ``host`` itself when it is a unix socket address (``unix:///path`` or
    ``unix:path``: workers on the orchestrator's machine skip TCP; the orchestrator's
    ``--target``/``--draft`` take the same address)."""
    return host if host.startswith("unix:") else f"{host}:{port}"


def launch(role: Role, config: argparse.Namespace) -> None:
    """Run the service until SIGINT/SIGTERM; exits 1 when it cannot start."""
    if asyncio.run(serve(role, config)):
        sys.exit(1)


def parser(package: str, doc: str | None, port: int) -> argparse.ArgumentParser:
    """The flag parser of ``python -m <package>`` (``usage: python -m <package> …``) with the
    listening flags every service has: ``--host`` (127.0.0.1) and ``--port`` (``port``)."""
    p = argparse.ArgumentParser(prog=f"python -m {package}", description=doc)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface; unix:///path: a unix socket)")
    p.add_argument("--port", type=int, default=port, help="port to listen on (0: any free port)")
    return p


def env_flags(p: argparse.ArgumentParser, renamed: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """Give every option of ``p`` its environment variable: the default becomes
    ``SPECDEC_<NAME>`` when set (typed like the built-in default, ``serving.server.env_default``),
    and ``--help`` shows the variable and the built-in default. NAME is the long flag
    (``--drain-seconds`` → ``SPECDEC_DRAIN_SECONDS``) unless ``renamed`` maps the flag to another
    (``{"--host": "target_host"}`` → ``SPECDEC_TARGET_HOST``: names kept for compatibility). Call
    it after the last ``add_argument`` (options added by helpers that read the variable themselves,
    ``serving.server.add_operation_flags``, get the same: the variable wins either way)."""
    renamed = renamed or {}
    for a in p._actions:
        longs = [o for o in a.option_strings if o.startswith("--")]
        if not longs or isinstance(a, argparse._HelpAction) or "[env SPECDEC_" in (a.help or ""):
            continue
        flag = longs[0]
        name = renamed.get(flag, flag[2:].replace("-", "_"))
        shown = a.default if a.default not in ("", None) else '""'
        a.default = env_default(name, a.default)
        a.help = f"{a.help + ' ' if a.help else ''}[env SPECDEC_{name.upper()}; default {shown}]"
    return p


def check_spin_settings(p: argparse.ArgumentParser) -> None:
    """Exit 2 with a usage error naming the variable when ``SPECDEC_SPIN_US`` or
    ``SPECDEC_SPIN_MAX_LIVE`` is malformed (``serving.datachannel.spin_settings``), at start-up
    rather than with a traceback at the first data-channel session."""
    from serving.datachannel import spin_settings

    try:
        spin_settings()
    except ValueError as e:
        p.error(str(e))


def parse_checked(p: argparse.ArgumentParser, argv, at_least: dict[str, int]):
    """``p.parse_args(argv)``, then every flag in ``at_least`` (``{"--prefill-chunk": 1}``) must be
    ≥ its bound, whether it came from the command line or its ``SPECDEC_*`` variable; otherwise
    exit 2 with argparse's usage error naming the flag, the bound and the value (instead of a
    traceback at warm-up)."""
    args = p.parse_args(argv)
    check_spin_settings(p)
    for flag, low in at_least.items():
        dest = next(a.dest for a in p._actions if flag in a.option_strings)
        if getattr(args, dest) < low:
            p.error(f"{flag} must be >= {low} (got {getattr(args, dest)})")
    return args

