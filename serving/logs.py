"""structlog JSON logs; a request id bound with ``bind_request`` appears on every line."""
from __future__ import annotations

import logging
import sys

import structlog


def configure(service: str, level: str = "INFO") -> structlog.stdlib.BoundLogger:
    """JSON lines on stderr with timestamp, level, service and bound context variables."""
    logging.basicConfig(stream=sys.stderr, level=level.upper(), format="%(message)s")
    structlog.configure(
        processors=[
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
