"""DecodeLink liveness: heartbeats name held requests; a decode that stops answering fails the
pending reads within the peer timeout (not the read deadline); dropped requests are reported. Any
``ReadTicket`` is settled, not only kvcore's ``SlotTicket``."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvcore.gates import OccupantFailed, SlotGate
from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc
from pdlink.links import DecodeLink, LinkError


class FakeDecode(transfer_pb2_grpc.TransferServicer):
    def __init__(self) -> None:
        self.beats: list[list[str]] = []
        self.hang = threading.Event()  # set: heartbeats and reads never answer
        self.release = threading.Event()
        self.unknown: set[str] = set()
        self.tp = (0, 1)  # the decode TP rank and size its acks report
        self.read_layers: list[int] = []  # the layers of the ReadReady calls, in arrival order

    def ExchangeLayout(self, request, context):
        return transfer_pb2.LayoutAck(
            accepted=True, layout_version=request.layout_version, decode_tp_rank=self.tp[0], decode_tp_size=self.tp[1]
        )

    def Heartbeat(self, request, context):
        if self.hang.is_set():
            self.release.wait(30)
        self.beats.append(list(request.request_ids))
        return transfer_pb2.PrefillHeartbeatReply(
            unknown_request_ids=[r for r in request.request_ids if r in self.unknown]
        )

    def ReadReady(self, request, context):
        self.read_layers.append(request.layer)
        self.release.wait(30)  # a decode that stopped in the middle of a pull
        return transfer_pb2.ReadResult(status=transfer_pb2.READ_DONE)


@pytest.fixture()
def decode():
    fake = FakeDecode()
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    transfer_pb2_grpc.add_TransferServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield fake, f"127.0.0.1:{port}"
    fake.release.set()
    server.stop(0)


def _link(endpoint: str, prefill_tp: tuple[int, int] = (0, 1)) -> DecodeLink:
    layout = transfer_pb2.LayoutMetadata(
        layout_version=7, model_id="m", prefill_tp_rank=prefill_tp[0], prefill_tp_size=prefill_tp[1]
    )
    link = DecodeLink(endpoint, layout, read_timeout_s=30, tls=None, peer_timeout_s=0.6, heartbeat_s=0.1)
    link.ensure_layout()
    return link


def test_a_decode_whose_tp_rank_this_prefill_rank_does_not_feed_is_refused_naming_both(decode):
    fake, endpoint = decode
    fake.tp = (1, 2)  # decode TP rank 1 of 2: fed by prefill TP ranks 2, 3 of 4, or 1 of 2
    with pytest.raises(LinkError, match="prefill tp rank 0 of 2 feeds decode tp rank 0 of 2, not decode tp rank 1"):
        _link(endpoint, prefill_tp=(0, 2))
    with pytest.raises(LinkError, match="prefill tp 1, decode tp 2; prefill TP must be >= decode TP"):
        _link(endpoint)
    _link(endpoint, prefill_tp=(3, 4)).close()  # a contributor of that rank


def test_heartbeats_name_the_held_requests_and_report_dropped_ones(decode):
    fake, endpoint = decode
    link = _link(endpoint)
    try:
        link.hold("a")
        link.hold("b")
        fake.unknown.add("b")
        deadline = time.monotonic() + 5
        while not link.dropped("b") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "no longer waits for request b" in link.dropped("b")
        assert link.dropped("a") == ""
        assert any(set(b) == {"a", "b"} for b in fake.beats)
        link.release("a")
        link.release("b")
        n = len(fake.beats)
        time.sleep(0.4)
        assert len(fake.beats) == n  # nothing held, nothing in flight: no heartbeats
    finally:
        link.close()


def test_an_unresponsive_decode_fails_pending_reads_within_the_peer_timeout(decode):
    fake, endpoint = decode
    link = _link(endpoint)
    gate = SlotGate(0)
    try:
        link.hold("r")
        ticket = gate.acquire(3, readers=[("r", endpoint)])
        ticket.computed()
        ticket.saved()
        fake.hang.set()
        t0 = time.monotonic()
        outcome = link.announce(ticket, ("r", endpoint), "r", 0, 16)
        assert outcome.result(timeout=10) is False
        assert time.monotonic() - t0 < 5  # the peer timeout (0.6 s + a beat), not the 30 s read deadline
        with pytest.raises(OccupantFailed, match=r"answered no heartbeat"):
            gate.acquire(4, timeout_s=1)
        assert "answered no heartbeat" in link.dropped("r")
        # new announces fail at once while the decode is gone
        t2 = gate.acquire(5, readers=[("r", endpoint)])
        assert link.announce(t2, ("r", endpoint), "r", 0, 16).result(timeout=1) is False
    finally:
        fake.release.set()
        link.close()


class RecordingTicket:
    """A ``ReadTicket`` of a caller's own (no kvcore gate): records how each read settled."""

    def __init__(self, layer: int, generation: int) -> None:
        self.layer, self.generation = layer, generation
        self.settled: list[tuple] = []

    def read_done(self, reader) -> None:
        self.settled.append(("done", reader))

    def read_failed(self, reader, reason: str) -> None:
        self.settled.append(("failed", reader, reason))


def test_a_read_ticket_of_the_callers_own_is_settled_by_the_answer(decode):
    fake, endpoint = decode
    fake.release.set()  # ReadReady answers READ_DONE at once
    link = _link(endpoint)
    try:
        ticket = RecordingTicket(layer=2, generation=5)
        assert link.announce(ticket, "reader", "r", 0, 16).result(timeout=10) is True
        assert ticket.settled == [("done", "reader")]
        link.hold("gone")
        fake.unknown.add("gone")
        deadline = time.monotonic() + 5
        while not link.dropped("gone") and time.monotonic() < deadline:
            time.sleep(0.02)
        failed = RecordingTicket(layer=3, generation=6)
        assert link.announce(failed, "reader", "gone", 0, 16).result(timeout=1) is False
        assert failed.settled == [("failed", "reader", "decode " + endpoint + " no longer waits for request gone")]
    finally:
        link.close()


def test_announces_leave_in_order_from_the_links_thread_and_none_is_stranded_by_a_close(decode):
    """The caller's thread only queues an announce (the call, and the gRPC polling thread an idle
    channel starts for it, are the link's); they are issued in order (concurrent calls may still
    arrive in another); one made after the link closed fails its read instead of waiting."""
    fake, endpoint = decode
    callers: set[str] = set()
    issued: list[int] = []
    fake.release.set()
    link = _link(endpoint)
    issue = link._issue

    def issued_on(*args):
        callers.add(threading.current_thread().name)
        issued.append(args[0].layer)  # (req, ticket, reader, outcome)
        return issue(*args)

    link._issue = issued_on
    tickets = [RecordingTicket(layer=i, generation=i) for i in range(12)]
    outcomes = [link.announce(t, "reader", "r", 0, 16) for t in tickets]
    assert all(o.result(timeout=10) for o in outcomes)
    assert (
        issued == list(range(12))
        and sorted(fake.read_layers) == issued
        and all(t.settled == [("done", "reader")] for t in tickets)
    )
    assert callers == {f"announce-{endpoint}_0"}  # one thread of the link's, never the caller's
    link.close()
    late = RecordingTicket(layer=12, generation=12)
    assert link.announce(late, "reader", "r", 0, 16).result(timeout=1) is False
    assert late.settled == [("failed", "reader", f"decode {endpoint}: the link closed")]
