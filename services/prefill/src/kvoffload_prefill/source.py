"""The prefill's LayerSource rows (the cross-host data path): rows of one layer buffer, served only
while the slot still holds the announced layer and generation and only to a request that reads
it. The layout a read names picks the buffers: rank 0's, or (TP) a follower's, attached here; the
slot gates are rank 0's for all of them (its followers take each slot when it does)."""

from __future__ import annotations

import grpc
import torch

from kvoffload_proto.v1 import transfer_pb2
from pdlink.layer_source import RowBuffer
from pdlink.refusals import MalformedRead, Refused, UnknownRequest


class LayerBufferRows(RowBuffer):
    def __init__(self, engine, buffers_by_version: dict) -> None:
        """``buffers_by_version``: layout_version -> the ``LayerBuffers`` that layout names."""
        self.engine, self.buffers_by_version = engine, dict(buffers_by_version)

    def rows(self, request: transfer_pb2.ReadLayerRequest) -> torch.Tensor:
        eng = self.engine
        bufs = self.buffers_by_version.get(request.layout_version)
        if bufs is None:
            raise Refused(
                f"layout_version {request.layout_version} is not one of this prefill's "
                f"({', '.join(map(str, sorted(self.buffers_by_version)))})",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if request.layer >= eng.plan.num_logical_layers:
            raise MalformedRead(f"layer {request.layer}: this prefill has {eng.plan.num_logical_layers} layers")
        try:
            ticket = eng.gates.ticket(request.layer)
        except ValueError as exc:
            raise Refused(str(exc), grpc.StatusCode.FAILED_PRECONDITION) from None
        if ticket.generation != request.generation:
            raise Refused(
                f"slot of layer {request.layer} holds generation {ticket.generation}, not {request.generation}",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if not any(reader[0] == request.request_id for reader in ticket.readers):  # only its readers see the rows
            raise UnknownRequest(
                f"request {request.request_id!r} does not read layer {request.layer} (generation {request.generation})"
            )
        buf = bufs.main(request.layer) if request.kind == transfer_pb2.PLANE_KIND_MAIN else bufs.indexer(request.layer)
        if request.src_end > buf.shape[0]:
            raise Refused(f"rows up to {request.src_end} of {buf.shape[0]}", grpc.StatusCode.OUT_OF_RANGE)
        return buf[request.src_start : request.src_end].contiguous().view(-1).view(torch.uint8)  # packed rows
