"""A Transfer or LayerSource call the connector refuses outright, with the gRPC status to answer it
with (the servicers abort the call with it; nothing was changed)."""

from __future__ import annotations

import grpc


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
