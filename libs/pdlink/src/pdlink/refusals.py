"""The Transfer and LayerSource calls an end of the contract refuses outright, each with the gRPC
status its servicer aborts the call with. A refusal changes nothing and pulls nothing."""

from __future__ import annotations

from typing import NoReturn

import grpc

__all__ = ["MalformedRead", "NoAcceptedLayout", "Refused", "UnknownRequest", "abort"]


class Refused(Exception):
    """A message refused outright; ``code`` is the gRPC status to answer it with."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class NoAcceptedLayout(Refused):
    """The message names a ``layout_version`` no accepted ExchangeLayout gave."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class MalformedRead(Refused):
    """A ReadReady (or ReadLayer) whose layer, row range or destination cannot be right."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownRequest(Refused):
    """The request is not waiting for KV here (consumer) or not being sent from here (source)."""

    code = grpc.StatusCode.NOT_FOUND


def abort(context: grpc.ServicerContext, exc: Refused) -> NoReturn:
    """End the gRPC call with the refusal's status and message (raises, as ``context.abort`` does)."""
    context.abort(exc.code, str(exc))
