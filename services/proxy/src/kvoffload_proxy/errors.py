"""One error type for everything the proxy answers with a non-2xx status.

`ProxyError.status` is the HTTP status the caller (client or decoder) gets; `body()` is the
OpenAI-style JSON error object, also used for the SSE `data: {"error": ...}` event mid-stream.
A backend's own 4xx answer is relayed unchanged through `relay_body`.
"""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    410: "cancelled_error",
    413: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class ProxyError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        backend: str | None = None,
        role: str | None = None,
        relay_body: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.param = param
        self.backend = backend
        self.role = role
        self.relay_body = relay_body

    @property
    def outcome(self) -> str:
        """Label for the requests-by-outcome metric."""
        if self.status == 504:
            return "timeout"
        if self.status == 410:
            return "cancelled"
        if self.status == 503:
            return "unavailable"
        return "client_error" if self.status < 500 else "upstream_error"

    def error_object(self) -> dict[str, Any]:
        if self.relay_body is not None and isinstance(self.relay_body.get("error"), dict):
            return self.relay_body["error"]
        err: dict[str, Any] = {
            "message": self.message,
            "type": _TYPES.get(self.status, "proxy_error"),
            "param": self.param,
            "code": self.status,
        }
        if self.backend:
            err[self.role or "backend"] = self.backend
        return err

    def body(self) -> dict[str, Any]:
        if self.relay_body is not None:
            return self.relay_body
        return {"error": self.error_object()}


def excerpt(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
