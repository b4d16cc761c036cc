"""The prefill's side of the release handshake: one ``DecodeLink`` per decode control endpoint.

A link exchanges the layout once (acked within ``LAYOUT_ACK_TIMEOUT_S``), then announces every
computed layer with a ReadReady whose answer settles the slot ticket: READ_DONE -> ``read_done``,
READ_FAILED or any RPC error or deadline -> ``read_failed`` with the reason. No answer is ever
waited for without a deadline, so a lost ack fails one request instead of stranding a slot.
"""

from __future__ import annotations

import threading
import time

import grpc
import structlog
from kvcore.gates import SlotTicket
from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc

log = structlog.get_logger(__name__)

LAYOUT_ACK_TIMEOUT_S = 10.0


class LinkError(RuntimeError):
    """A decode endpoint refused the layout or cannot be reached."""


class _Outcome:
    """READ_DONE (True) or not (False) of one announce, once its answer settled the ticket."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._ok = False

    def set(self, ok: bool) -> None:
        self._ok = ok
        self._done.set()

    def result(self, timeout: float | None = None) -> bool:
        if not self._done.wait(timeout):
            raise TimeoutError("no answer to ReadReady in time")
        return self._ok


class DecodeLink:
    """gRPC client of one decode endpoint ``host:port``."""

    def __init__(self, endpoint: str, layout: transfer_pb2.LayoutMetadata, read_timeout_s: float) -> None:
        self.endpoint = endpoint
        self._layout = layout
        self._read_timeout_s = read_timeout_s
        self._channel = grpc.insecure_channel(endpoint)
        self._stub = transfer_pb2_grpc.TransferStub(self._channel)
        self._accepted = False
        self._lock = threading.Lock()
        self.read_latency_ms: list[float] = []

    def ensure_layout(self) -> None:
        """ExchangeLayout once per link; raises LinkError with the decode's reason."""
        with self._lock:
            if self._accepted:
                return
            try:
                ack = self._stub.ExchangeLayout(self._layout, timeout=LAYOUT_ACK_TIMEOUT_S)
            except grpc.RpcError as exc:
                raise LinkError(f"decode {self.endpoint}: layout exchange failed: {exc.code().name}: "
                                f"{exc.details()}") from None
            if not ack.accepted:
                raise LinkError(f"decode {self.endpoint} refused the layout: {ack.reason}")
            self._accepted = True

    def announce(self, ticket: SlotTicket, reader, request_id: str, start: int, end: int) -> "_Outcome":
        """ReadReady for rows [start, end) of ``ticket.layer``; the answer settles ``reader``.

        Returns the call's future: its result is True for READ_DONE, False for a failure."""
        req = transfer_pb2.ReadReadyRequest(request_id=request_id, layer=ticket.layer, generation=ticket.generation,
                                            src_start=start, src_end=end, dst_start=start,
                                            layout_version=self._layout.layout_version)
        sent = time.monotonic()
        future = self._stub.ReadReady.future(req, timeout=self._read_timeout_s)

        def settle(f) -> None:
            try:
                result = f.result()
            except grpc.RpcError as exc:
                reason = f"decode {self.endpoint}: ReadReady {exc.code().name}: {exc.details()}"
                log.warning("read_failed", request_id=request_id, layer=ticket.layer, reason=reason)
                ticket.read_failed(reader, reason)
                return
            if result.status == transfer_pb2.READ_DONE:
                self.read_latency_ms.append((time.monotonic() - sent) * 1000)
                ticket.read_done(reader)
            else:
                log.warning("read_failed", request_id=request_id, layer=ticket.layer, reason=result.reason)
                ticket.read_failed(reader, result.reason or "READ_FAILED without a reason")

        outcome = _Outcome()

        def settle_and_report(f) -> None:
            try:
                settle(f)
            finally:
                outcome.set(not f.exception() and f.result().status == transfer_pb2.READ_DONE)

        future.add_done_callback(settle_and_report)
        return outcome

    def prefill_done(self, request_id: str, num_prompt_tokens: int, first_token: int) -> None:
        try:
            reply = self._stub.PrefillDone(transfer_pb2.PrefillDoneRequest(
                request_id=request_id, num_prompt_tokens=num_prompt_tokens, first_token=first_token,
                layout_version=self._layout.layout_version), timeout=self._read_timeout_s)
        except grpc.RpcError as exc:
            raise LinkError(f"decode {self.endpoint}: PrefillDone {exc.code().name}: {exc.details()}") from None
        if not reply.accepted:
            raise LinkError(f"decode {self.endpoint} refused the prefill result: {reply.reason}")

    def close(self) -> None:
        self._channel.close()
