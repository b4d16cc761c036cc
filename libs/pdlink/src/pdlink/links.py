"""The producer's side of the release handshake, used by the prefill service and the vLLM producer
connector: one ``DecodeLink`` per decode control endpoint.

A link exchanges the layout once (acked within ``LAYOUT_ACK_TIMEOUT_S``), then announces every
computed layer with a ReadReady whose answer settles the slot ticket: READ_DONE -> ``read_done``,
READ_FAILED or any RPC error or deadline -> ``read_failed`` with the reason. No answer is ever
waited for without a deadline, so a lost ack fails one request instead of stranding a slot.

While the link holds requests (queued, computing, or waiting for READ_DONE) it sends a heartbeat
every ``heartbeat_s``: it renews the decode's watchdog for them, and its reply names the requests
the decode no longer waits for (``dropped``), which the worker stops computing. When the decode
answers no heartbeat for ``peer_timeout_s`` (dead, hung, or unreachable), every pending ReadReady
of the link is cancelled and fails its slot's read with a reason naming the decode — well before
the per-read deadline — and new announces fail at once until a heartbeat succeeds again.

Announces are issued in order by the link's own thread (``announce`` queues them and returns): a
ReadReady on an idle gRPC channel starts the channel's polling thread, and that start, with the
call's set-up, was 5 % of a prefill's engine thread under load (each announce found the channel
idle again). A queued announce of a decode that is gone by the time it is issued, or of a link
that closed, fails its read like one made then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc
import structlog

from kvcore.pdpair import tp_handshake_problem
from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc
from svcruntime.tls import PROCESS, secure_or_insecure_channel

log = structlog.get_logger(__name__)

LAYOUT_ACK_TIMEOUT_S = 10.0
RECONNECT_WAIT_S = 3.0  # how long ensure_layout waits for a decode that is not reachable right now


class ReadTicket(Protocol):
    """What ``DecodeLink.announce`` needs of the ticket of an announced layer (``kvcore.slottickets.SlotTicket``
    is one): the ``layer`` and ``generation`` it names, and how one reader's read of it settles."""

    @property
    def layer(self) -> int: ...

    @property
    def generation(self) -> int: ...

    def read_done(self, reader: Hashable) -> None: ...

    def read_failed(self, reader: Hashable, reason: str) -> None: ...


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

    def failed(self) -> bool:
        """Answered, and not READ_DONE."""
        return self._done.is_set() and not self._ok

    def result(self, timeout: float | None = None) -> bool:
        if not self._done.wait(timeout):
            raise TimeoutError("no answer to ReadReady in time")
        return self._ok


class DecodeLink:
    """gRPC client of one decode endpoint ``host:port``."""

    def __init__(
        self,
        endpoint: str,
        layout: transfer_pb2.LayoutMetadata,
        read_timeout_s: float,
        tls=PROCESS,
        peer_timeout_s: float = 10.0,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.endpoint = endpoint
        self._layout = layout
        self._read_timeout_s = read_timeout_s
        self._peer_timeout_s = peer_timeout_s
        self._heartbeat_s = heartbeat_s
        self._channel = secure_or_insecure_channel(endpoint, tls)  # the process's TLS by default
        self._stub = transfer_pb2_grpc.TransferStub(self._channel)
        self._accepted = False
        self._lock = threading.Lock()
        self._layout_lock = threading.Lock()  # one layout exchange at a time (RPCs under it)
        self.read_latency_ms: list[float] = []
        self._held: dict[str, int] = {}  # request id -> holders (a request is held once per run)
        self._dropped: dict[str, str] = {}  # held request id -> why the decode no longer waits for it
        self._inflight: set = set()  # ReadReady futures not answered yet
        self._last_answer = time.monotonic()
        self._dead = ""  # why the decode is considered gone ("" while it answers)
        self._stop = threading.Event()
        self._issuer = ThreadPoolExecutor(1, thread_name_prefix=f"announce-{endpoint}")  # ReadReady calls, in order
        self._beater = threading.Thread(target=self._beat, name=f"heartbeat-{endpoint}", daemon=True)
        self._beater.start()

    def ensure_layout(self) -> None:
        """ExchangeLayout once per link; raises LinkError with the decode's reason."""
        with self._layout_lock:
            if self._accepted:
                try:  # still known there? a restarted decode lost the layout and needs it again
                    self._stub.Heartbeat(
                        transfer_pb2.PrefillHeartbeat(layout_version=self._layout.layout_version),
                        timeout=RECONNECT_WAIT_S,
                        wait_for_ready=True,
                    )
                    with self._lock:
                        self._last_answer, self._dead = time.monotonic(), ""
                    return
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise LinkError(
                            f"decode {self.endpoint} unreachable: {exc.code().name}: {exc.details()}"
                        ) from None
                    self._accepted = False
            try:
                ack = self._stub.ExchangeLayout(self._layout, timeout=LAYOUT_ACK_TIMEOUT_S, wait_for_ready=True)
            except grpc.RpcError as exc:
                raise LinkError(
                    f"decode {self.endpoint}: layout exchange failed: {exc.code().name}: {exc.details()}"
                ) from None
            if not ack.accepted:
                raise LinkError(f"decode {self.endpoint} refused the layout: {ack.reason}")
            tp = tp_handshake_problem(
                self._layout.prefill_tp_size, self._layout.prefill_tp_rank, ack.decode_tp_size, ack.decode_tp_rank
            )
            if tp:  # the decode accepted, but its rank is not one this prefill rank feeds
                raise LinkError(
                    f"decode {self.endpoint} accepted the layout but is not this prefill rank's target: {tp}"
                )
            self._accepted = True
            self._last_answer, self._dead = time.monotonic(), ""

    # ---- liveness ------------------------------------------------------------------------------

    def hold(self, request_id: str) -> None:
        """The link now works for ``request_id`` (until ``release``): heartbeats name it."""
        with self._lock:
            if not self._held and not self._inflight:
                self._last_answer = time.monotonic()  # silence counts only while there is work
            self._held[request_id] = self._held.get(request_id, 0) + 1

    def release(self, request_id: str) -> None:
        with self._lock:
            n = self._held.get(request_id, 0) - 1
            if n > 0:
                self._held[request_id] = n
            else:
                self._held.pop(request_id, None)
                self._dropped.pop(request_id, None)

    def dropped(self, request_id: str) -> str:
        """Why the decode no longer waits for ``request_id`` ("" while it does)."""
        with self._lock:
            return self._dropped.get(request_id, "") or (self._dead if request_id in self._held else "")

    def _beat(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            with self._lock:
                ids = list(self._held)
                if not ids and not self._inflight:
                    continue
            try:
                reply = self._stub.Heartbeat(
                    transfer_pb2.PrefillHeartbeat(layout_version=self._layout.layout_version, request_ids=ids),
                    timeout=min(self._heartbeat_s * 2, self._peer_timeout_s),
                )
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # a restarted decode forgot our layout
                    with self._lock:
                        self._accepted = False
                    self._declare_dead(f"decode {self.endpoint} restarted (it lost the layout): {exc.details()}")
                    continue
                silent = time.monotonic() - self._last_answer
                if silent > self._peer_timeout_s:
                    self._declare_dead(
                        f"decode {self.endpoint} answered no heartbeat for {silent:.1f} s "
                        f"(last error {exc.code().name})"
                    )
                continue
            with self._lock:
                self._last_answer, self._dead = time.monotonic(), ""
                for rid in reply.unknown_request_ids:
                    if rid in self._held and rid not in self._dropped:
                        self._dropped[rid] = f"decode {self.endpoint} no longer waits for request {rid}"
                        log.warning("request_dropped_by_decode", request_id=rid, decode=self.endpoint)

    def _declare_dead(self, reason: str) -> None:
        with self._lock:
            first = not self._dead
            self._dead = reason
            pending = list(self._inflight)
        if first:
            log.warning("decode_unresponsive", decode=self.endpoint, reason=reason, pending_reads=len(pending))
        for future in pending:
            future.cancel()

    def announce(
        self, ticket: ReadTicket, reader, request_id: str, start: int, end: int, block_ids: Sequence[int] = ()
    ) -> _Outcome:
        """ReadReady for rows [start, end) of ``ticket.layer``; the answer settles ``reader``.
        ``block_ids``: a paged prefill's blocks holding those rows, where the decode reads them through
        a transfer engine (``ReadReadyRequest.src_block_ids``).

        Returns the announce's outcome: True once READ_DONE settled the ticket, False for a failure.
        The call itself is issued by the link's thread, in order (module doc)."""
        outcome = _Outcome()
        if self._fail_if_gone(ticket, reader, request_id, outcome):
            return outcome
        req = transfer_pb2.ReadReadyRequest(
            request_id=request_id,
            layer=ticket.layer,
            generation=ticket.generation,
            src_start=start,
            src_end=end,
            dst_start=start,
            layout_version=self._layout.layout_version,
            src_block_ids=block_ids,
        )
        try:
            self._issuer.submit(self._issue, req, ticket, reader, outcome)
        except RuntimeError:  # the link closed (its issuer shut down)
            self._fail(ticket, reader, request_id, outcome, f"decode {self.endpoint}: the link closed")
        return outcome

    def _fail_if_gone(self, ticket: ReadTicket, reader, request_id: str, outcome: _Outcome) -> bool:
        gone = self.dropped(request_id)
        if gone:  # the decode is unresponsive or dropped the request: fail the read at once
            self._fail(ticket, reader, request_id, outcome, gone)
        return bool(gone)

    @staticmethod
    def _fail(ticket: ReadTicket, reader, request_id: str, outcome: _Outcome, reason: str) -> None:
        log.warning("read_failed", request_id=request_id, layer=ticket.layer, reason=reason)
        ticket.read_failed(reader, reason)
        outcome.set(False)

    def _issue(self, req: transfer_pb2.ReadReadyRequest, ticket: ReadTicket, reader, outcome: _Outcome) -> None:
        """On the link's thread: the ReadReady call; its answer settles ``reader`` and ``outcome``."""
        request_id = req.request_id
        if self._fail_if_gone(ticket, reader, request_id, outcome):
            return
        sent = time.monotonic()
        try:
            future = self._stub.ReadReady.future(req, timeout=self._read_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a closed channel: the read fails, nothing is stranded
            self._fail(ticket, reader, request_id, outcome, f"decode {self.endpoint}: ReadReady not sent: {exc}")
            return
        with self._lock:
            self._inflight.add(future)

        def settle(f) -> bool:
            with self._lock:
                self._inflight.discard(f)
            if f.cancelled():
                reason = self._dead or f"decode {self.endpoint}: ReadReady cancelled"
            else:
                try:
                    result = f.result()
                except grpc.RpcError as exc:
                    reason = f"decode {self.endpoint}: ReadReady {exc.code().name}: {exc.details()}"
                else:
                    with self._lock:
                        self._last_answer = time.monotonic()
                    if result.status == transfer_pb2.READ_DONE:
                        self.read_latency_ms.append((time.monotonic() - sent) * 1000)
                        ticket.read_done(reader)
                        return True
                    reason = result.reason or "READ_FAILED without a reason"
            log.warning("read_failed", request_id=request_id, layer=ticket.layer, reason=reason)
            ticket.read_failed(reader, reason)
            return False

        def settle_and_report(f) -> None:
            ok = False
            try:
                ok = settle(f)
            finally:
                outcome.set(ok)

        future.add_done_callback(settle_and_report)

    def prefill_done(
        self,
        request_id: str,
        num_prompt_tokens: int,
        first_token: int,
        first_logprob=None,
        draft_token: int | None = None,
    ) -> None:
        """``first_logprob``: the first token's ``TokenLogprob`` when the request asked for logprobs;
        ``draft_token``: the MTP layer's greedy guess for the token after ``first_token``, if any."""
        msg = transfer_pb2.PrefillDoneRequest(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            first_token=first_token,
            layout_version=self._layout.layout_version,
        )
        if draft_token is not None:
            msg.has_draft, msg.draft_token = True, draft_token
        if first_logprob is not None:
            msg.first_token_logprobs.CopyFrom(
                transfer_pb2.TokenLogprobs(
                    token=first_logprob.token,
                    logprob=first_logprob.logprob,
                    top_tokens=[t for t, _ in first_logprob.top],
                    top_logprobs=[lp for _, lp in first_logprob.top],
                )
            )
        try:
            reply = self._stub.PrefillDone(msg, timeout=self._read_timeout_s)
        except grpc.RpcError as exc:
            raise LinkError(f"decode {self.endpoint}: PrefillDone {exc.code().name}: {exc.details()}") from None
        if not reply.accepted:
            raise LinkError(f"decode {self.endpoint} refused the prefill result: {reply.reason}")

    def close(self) -> None:
        self._stop.set()
        self._beater.join(timeout=5)
        self._issuer.shutdown(wait=True)  # queued announces issued (a call returns at once), later ones refused
        self._channel.close()
