"""LayerSource: the cross-host data path. Streams rows of one layer buffer in bounded chunks, only
while the slot still holds the announced layer and generation (else FAILED_PRECONDITION). The
layout a read names picks the buffers: rank 0's, or (TP) a follower's, attached here; the slot
gates are rank 0's for all of them (its followers take each slot when it does)."""

from __future__ import annotations

import grpc
import torch
from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc
from pdlink.chunks import data_chunks


class LayerSourceServicer(transfer_pb2_grpc.LayerSourceServicer):
    def __init__(self, engine, buffers_by_version: dict) -> None:
        """``buffers_by_version``: layout_version -> the ``LayerBuffers`` that layout names."""
        self.engine, self.buffers_by_version = engine, dict(buffers_by_version)

    def ReadLayer(self, request, context):
        eng = self.engine
        bufs = self.buffers_by_version.get(request.layout_version)
        if bufs is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"layout_version {request.layout_version} is not one of this prefill's "
                          f"({', '.join(map(str, sorted(self.buffers_by_version)))})")
        if request.layer >= eng.plan.num_logical_layers or request.src_end < request.src_start:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"layer {request.layer} or range is malformed")
        if request.kind not in (transfer_pb2.PLANE_KIND_MAIN, transfer_pb2.PLANE_KIND_INDEXER):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"kind {request.kind}: must be PLANE_KIND_MAIN or PLANE_KIND_INDEXER")
        try:
            ticket = eng.gates.ticket(request.layer)
        except ValueError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if ticket.generation != request.generation:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"slot of layer {request.layer} holds generation {ticket.generation}, not {request.generation}")
        if not any(reader[0] == request.request_id for reader in ticket.readers):  # only its readers see the rows
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"request {request.request_id!r} does not read layer {request.layer} (generation "
                          f"{request.generation})")
        buf = bufs.main(request.layer) if request.kind == transfer_pb2.PLANE_KIND_MAIN \
            else bufs.indexer(request.layer)
        if request.src_end > buf.shape[0]:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"rows up to {request.src_end} of {buf.shape[0]}")
        data = buf[request.src_start : request.src_end].contiguous().view(-1).view(torch.uint8)  # packed rows
        yield from data_chunks(data)
