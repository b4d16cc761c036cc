"""structlog JSON logs for the services: one event per line on stderr, the service on every line.

One request id follows a request through proxy, decode and prefill: the proxy's ``X-Request-Id``.
Between prefill and decode a request travels under its own wire id (one per prompt of a prompt
list); a service that learns both links them in ``REQUEST_IDS`` for the request's lifetime, and
every log line whose ``request_id`` is a linked wire id is rewritten to carry the X-Request-Id as
``request_id`` and the wire id as ``child_id`` — so existing log calls need no change.
"""

from __future__ import annotations

import logging
import sys
import threading

import structlog


class RequestIds:
    """wire id -> X-Request-Id, for the requests in flight; also the structlog processor."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trace: dict[str, str] = {}

    def link(self, wire_id: str, request_id: str | None) -> None:
        if request_id and request_id != wire_id:
            with self._lock:
                self._trace[wire_id] = request_id

    def unlink(self, wire_id: str) -> None:
        with self._lock:
            self._trace.pop(wire_id, None)

    def __call__(self, _logger, _name, event: dict) -> dict:
        rid = event.get("request_id")
        if isinstance(rid, str):
            with self._lock:
                trace = self._trace.get(rid)
            if trace is not None:
                event["request_id"], event["child_id"] = trace, rid
        return event


REQUEST_IDS = RequestIds()


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when a line is written (not when logging was configured): a
    replaced stream (a test's capture, closed since) must never break a later log call."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(service: str, level: str = "info") -> None:
    """Every structlog logger of the process -> one JSON object per line (service, level, time, event)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            REQUEST_IDS,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            lambda _logger, _name, event: {"service": service, **event},
            structlog.processors.JSONRenderer(default=repr),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()),
        cache_logger_on_first_use=False,
    )
