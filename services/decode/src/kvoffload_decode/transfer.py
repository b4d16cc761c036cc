"""The decode's control port, ``kvoffload.v1.Transfer``: layout exchange, per-layer pulls
(READ_READY -> READ_DONE/FAILED), heartbeats and the end of a prefill. Thin: each request becomes
a ``LayerPuller`` call (``kvoffload_decode.pull``, which owns the pull path); its result becomes
the reply, and its refusal (``PullRefused``) the gRPC status the call is aborted with.
"""

from __future__ import annotations

import grpc
import torch
from kvcore.layout import KVLayout
from dsamodel.sampling import TokenLogprob
from svcruntime.tls import PROCESS, secure_or_insecure_channel
from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc
from pdlink.memfabric import MemfabricRows
from pdlink.sources import RowSources

from kvoffload_decode.loop import DecodeLoop
from kvoffload_decode.pull import LayerPuller, MalformedRead, NoAcceptedLayout, PullRefused, UnknownRequest

STATUS = {NoAcceptedLayout: grpc.StatusCode.FAILED_PRECONDITION, MalformedRead: grpc.StatusCode.INVALID_ARGUMENT,
          UnknownRequest: grpc.StatusCode.NOT_FOUND}  # the status of each refusal


def _abort(context, exc: PullRefused):
    context.abort(STATUS.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT), str(exc))


class TransferServicer(transfer_pb2_grpc.TransferServicer):
    """Serves ``kvoffload.v1.Transfer`` for one decode rank over a ``LayerPuller``."""

    def __init__(self, loop: DecodeLoop, layout: KVLayout, model_id: str, host_id: str, dtype: torch.dtype,
                 read_retries: int = 2, tls=PROCESS, memfabric: MemfabricRows | None = None, *,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.dtype = dtype
        # streamed pulls from a prefill's LayerSource go over ``tls``: the process's TLS by default;
        # with ``memfabric`` (transfer_backend "memfabric") every pull reads through it instead
        sources = RowSources(lambda endpoint: secure_or_insecure_channel(endpoint, tls))
        self.puller = LayerPuller(loop, layout, model_id, host_id, sources, read_retries=read_retries,
                                  memfabric=memfabric, tp_rank=tp_rank, tp_size=tp_size)

    @property
    def counters(self) -> dict[str, float]:
        """A consistent copy of the pull counters (``kvoffload_decode.pull.COUNTERS``)."""
        return self.puller.counters.snapshot()

    def ExchangeLayout(self, request, context):
        reason = self.puller.exchange_layout(request)
        return transfer_pb2.LayoutAck(accepted=not reason, reason=reason, layout_version=request.layout_version,
                                      decode_tp_rank=self.puller.tp_rank, decode_tp_size=self.puller.tp_size,
                                      shared_memory=self.puller.memfabric is None
                                      and self.puller.same_host(request.host_id))

    def ReadReady(self, request, context):
        try:
            out = self.puller.read_ready(request)
        except PullRefused as exc:
            _abort(context, exc)
        if not out.done:
            return transfer_pb2.ReadResult(status=transfer_pb2.READ_FAILED, reason=out.reason)
        return transfer_pb2.ReadResult(status=transfer_pb2.READ_DONE, bytes_read=out.bytes_read,
                                       read_ms=int(out.read_ms))

    def Heartbeat(self, request, context):
        try:
            unknown = self.puller.heartbeat(request.layout_version, request.request_ids)
        except PullRefused as exc:
            _abort(context, exc)
        return transfer_pb2.PrefillHeartbeatReply(unknown_request_ids=unknown)

    def PrefillDone(self, request, context):
        try:
            reason = self.puller.prefill_done(request.layout_version, request.request_id,
                                              request.num_prompt_tokens, request.first_token,
                                              first_logprob_of(request),
                                              request.draft_token if request.has_draft else None)
        except PullRefused as exc:
            _abort(context, exc)
        return transfer_pb2.PrefillDoneReply(accepted=not reason, reason=reason)

    def close(self) -> None:
        self.puller.close()


def first_logprob_of(request) -> TokenLogprob | None:
    """PrefillDoneRequest.first_token_logprobs as a TokenLogprob (None when not sent or malformed:
    the loop then refuses a request that asked for logprobs)."""
    if not request.HasField("first_token_logprobs"):
        return None
    m = request.first_token_logprobs
    if len(m.top_tokens) != len(m.top_logprobs):
        return None
    return TokenLogprob(m.token, m.logprob, tuple(zip(m.top_tokens, m.top_logprobs)))
