"""The producer's side of the data path: ``kvoffload.v1.LayerSource`` over a ``RowBuffer``, the rows
a producer can serve (the prefill service's shared layer buffers, a vLLM prefill's paged blocks).
The servicer checks what every producer requires of a ReadLayer (a known plane kind, a range that
is not reversed), asks the buffer for the rows, and streams them as ``DataChunk`` messages
(``pdlink.chunks``); the buffer's ``Refused`` becomes the gRPC status the call is aborted with."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc
from pdlink.chunks import data_chunks
from pdlink.refusals import MalformedRead, Refused, abort

__all__ = ["LayerSourceServicer", "RowBuffer"]


class RowBuffer(ABC):
    """What a producer serves over its LayerSource."""

    @abstractmethod
    def rows(self, request: transfer_pb2.ReadLayerRequest) -> torch.Tensor:
        """Rows [src_start, src_end) of plane ``kind`` of ``layer``, as the request's ``generation``
        holds them for ``request_id``: packed, contiguous 1-D uint8. ``Refused`` when they cannot be
        served (another layout or generation, a request not read from here, out of range)."""


class LayerSourceServicer(transfer_pb2_grpc.LayerSourceServicer):
    def __init__(self, buffer: RowBuffer) -> None:
        self.buffer = buffer

    def ReadLayer(self, request, context):
        try:
            if request.kind not in (transfer_pb2.PLANE_KIND_MAIN, transfer_pb2.PLANE_KIND_INDEXER):
                raise MalformedRead(f"kind {request.kind}: must be PLANE_KIND_MAIN or PLANE_KIND_INDEXER")
            if request.src_end < request.src_start:
                raise MalformedRead(f"range [{request.src_start}, {request.src_end}) is reversed")
            data = self.buffer.rows(request)
        except Refused as exc:
            abort(context, exc)
        yield from data_chunks(data)
