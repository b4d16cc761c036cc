"""The one logging set-up of every kvoffload service: structlog JSON, one event per line on stderr,
with the service, level and UTC time on every line, and the request id wherever one is known.

Request-scoped fields bound in ``structlog.contextvars`` (the proxy's HTTP middleware binds
``request_id``) appear on every line logged while serving that request. Records of stdlib loggers
(aiohttp's, grpc's) go through the same renderer, so a service's stderr is JSON lines only.

``quiet_logs`` is the set-up of a tool whose stdout is one JSON document (the benches).

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
from typing import Any, TextIO, cast

import structlog
from structlog.typing import EventDict, Processor


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

    def __call__(self, _logger: Any, _name: str, event: EventDict) -> EventDict:
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
    replaced stream (a test's capture, closed since) must never break a later log call. Each line
    arrives as one ``write`` (structlog's WriteLogger and logging's StreamHandler both write line +
    newline at once); one lock keeps lines from two threads, or from the two paths, whole."""

    _lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def _add_service(service: str) -> Processor:
    def processor(_logger: Any, _name: str, event: EventDict) -> EventDict:
        return {"service": service, **event}

    return processor


def configure_logging(service: str, level: str = "info", stream: TextIO | None = None) -> None:
    """Every structlog logger of the process, and the stdlib root logger, -> one JSON object per
    line (service, level, UTC time, event, fields) on ``stream`` (default: whatever ``sys.stderr``
    is at each write). ``level``: debug|info|warning|error|critical; anything else is ValueError."""
    if not isinstance(level, str) or level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}; got {level!r}")
    numeric = LEVELS[level.lower()]
    # _CurrentStderr has the write/flush that WriteLogger and StreamHandler call, not all of TextIO
    out = stream if stream is not None else cast(TextIO, _CurrentStderr())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        REQUEST_IDS,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    render: list[Processor] = [
        structlog.processors.format_exc_info,
        _add_service(service),
        structlog.processors.JSONRenderer(default=repr),
    ]
    structlog.configure(
        processors=[*shared, *render],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(out),  # line + newline in one write
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def quiet_logs() -> None:
    """For a tool that prints one JSON document on stdout (the benches): info logs are dropped, and
    warnings and errors go to stderr (the ``sys.stderr`` of the moment each is logged)."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
    )
