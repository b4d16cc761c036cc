"""``kvoffload.v1.Transfer`` over a ``PullConsumer``: each call becomes a consumer call, its result
the reply, its refusal (``pdlink.refusals.Refused``) the gRPC status the call is aborted with."""

from __future__ import annotations

from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc
from pdlink.pull_consumer import PullConsumer
from pdlink.refusals import Refused, abort

__all__ = ["TransferServicer"]


class TransferServicer(transfer_pb2_grpc.TransferServicer):
    """Serves one consumer rank's control port."""

    def __init__(self, consumer: PullConsumer) -> None:
        self.consumer = consumer

    @property
    def counters(self) -> dict[str, float]:
        """A consistent copy of the pull counters (``pdlink.pullcounters.COUNTERS``)."""
        return self.consumer.counters.snapshot()

    def ExchangeLayout(self, request, context):
        c = self.consumer
        reason = c.exchange_layout(request)
        return transfer_pb2.LayoutAck(
            accepted=not reason,
            reason=reason,
            layout_version=request.layout_version,
            decode_tp_rank=c.tp_rank,
            decode_tp_size=c.tp_size,
            shared_memory=c.engine is None and c.same_host(request.host_id),
        )

    def ReadReady(self, request, context):
        try:
            out = self.consumer.read_ready(request)
        except Refused as exc:
            abort(context, exc)
        if not out.done:
            return transfer_pb2.ReadResult(status=transfer_pb2.READ_FAILED, reason=out.reason)
        return transfer_pb2.ReadResult(
            status=transfer_pb2.READ_DONE, bytes_read=out.bytes_read, read_ms=int(out.read_ms)
        )

    def Heartbeat(self, request, context):
        try:
            unknown = self.consumer.heartbeat(request.layout_version, request.request_ids)
        except Refused as exc:
            abort(context, exc)
        return transfer_pb2.PrefillHeartbeatReply(unknown_request_ids=unknown)

    def PrefillDone(self, request, context):
        try:
            reason = self.consumer.prefill_done(request)
        except Refused as exc:
            abort(context, exc)
        return transfer_pb2.PrefillDoneReply(accepted=not reason, reason=reason)

    def close(self) -> None:
        self.consumer.close()
