"""structlog JSON logs; a request id bound with ``bind_request`` appears on every line."""
from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(service: str, level: str = "INFO") -> structlog.stdlib.BoundLogger:
    """JSON lines on stderr with timestamp, level, service and bound context variables."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    shard = os.environ.get("SPECDEC_SHARD", "")  # one of a sharded orchestrator's processes (serving.shards)
    structlog.configure(
        processors=[
            *([lambda _, __, event: {**event, "shard": shard}] if shard else []),  # every thread's lines
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger()


def bind_request(request_id: str) -> None:
    structlog.contextvars.bind_contextvars(request_id=request_id)


def bind_session(context) -> str:
    """Bind the client's request id (metadata ``x-request-id``) and the worker id
    (``x-worker-id``, or a fresh one) to every log line of this RPC; returns the worker id."""
    import uuid

    md = dict(context.invocation_metadata() or ())
    worker_id = md.get("x-worker-id") or uuid.uuid4().hex
    structlog.contextvars.bind_contextvars(request_id=md.get("x-request-id", ""), worker_id=worker_id)
    return worker_id


def session_metadata(worker_id: str) -> tuple[tuple[str, str], ...]:
    """Metadata for a worker session: the worker id and the client's request id bound to the
    caller's logs (``bind_request``)."""
    rid = structlog.contextvars.get_contextvars().get("request_id", "")
    return (("x-worker-id", worker_id), ("x-request-id", rid))
