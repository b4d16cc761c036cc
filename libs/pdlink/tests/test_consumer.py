"""``pdlink.pull_consumer.PullConsumer`` and its gRPC servicers over an in-memory ``RowSink`` that, like a
vLLM decode, widens every read to whole blocks and takes one plane: the common layout checks come
before the sink's, each hook is called when the module doc says (``begin`` -> read -> ``install``,
``failed`` on a failed read, ``end`` after every read that ``begin`` started), retries stop when the
request no longer waits, and every refusal reaches gRPC as its status. (Under a real decode:
services/decode/tests/test_pull.py; under vLLM: libs/kvoffload_vllm/tests/test_d2h_pull.py.)"""

from __future__ import annotations

import grpc
import pytest
import torch

from kvoffload_proto.v1 import transfer_pb2 as pb
from pdlink.layer_source import LayerSourceServicer, RowBuffer
from pdlink.pull_consumer import Plane, PullConsumer, Read, ReadOutcome, RowSink
from pdlink.refusals import MalformedRead, NoAcceptedLayout, Refused, UnknownRequest
from pdlink.transfer_service import TransferServicer

BS, ROW, LAYERS, VERSION = 4, 3, 2, 5


class BlockSink(RowSink):
    """Requests of ``tokens`` rows; reads widened to blocks of ``BS``; a log of every hook call."""

    num_layers, block_size = LAYERS, BS

    def __init__(self) -> None:
        self.tokens = {"r": 10}
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        self.calls: list[tuple] = []
        self.fail_install = False

    def layout_problem(self, meta) -> str:
        return "" if all(lay.main_row_bytes == ROW for lay in meta.layers) else "layers: rows of another size"

    def planes(self, layer: int) -> list[Plane]:
        return [Plane(pb.PLANE_KIND_MAIN, ROW)]

    def begin(self, read: Read) -> range | ReadOutcome:
        r = read.request
        if r.request_id not in self.tokens:
            raise UnknownRequest(f"request {r.request_id!r} is not waiting for KV here")
        if r.src_end > self.tokens[r.request_id]:
            raise MalformedRead(f"rows up to {r.src_end}")
        self.calls.append(("begin", r.layer))
        if (r.request_id, r.layer) in self.rows:
            return ReadOutcome(done=True)
        return range(r.src_start // BS * BS, -(-r.src_end // BS) * BS)

    def wanted(self, request_id: str) -> bool:
        self.calls.append(("wanted", request_id))
        return request_id in self.tokens

    def install(self, read: Read, rows: range, planes: list[torch.Tensor]) -> float:
        self.calls.append(("install", read.layer, rows.start, rows.stop, tuple(planes[0].shape)))
        if self.fail_install:
            raise RuntimeError("the request stopped loading")
        self.rows[(read.request_id, read.layer)] = planes[0]
        return 0.0

    def failed(self, read: Read, reason: str) -> None:
        self.calls.append(("failed", read.layer, reason))

    def end(self, read: Read) -> None:
        self.calls.append(("end", read.layer))

    def heard(self, request_id: str, endpoint: str) -> bool:
        self.calls.append(("heard", request_id, endpoint))
        return request_id in self.tokens

    def prefill_done(self, request, endpoint: str) -> str:
        return "" if request.request_id in self.tokens else f"{request.request_id} is not here"


class Sources:
    """``RowSources``' contract: rows whose every byte is its row number; ``failures`` raised first."""

    def __init__(self) -> None:
        self.asks: list[tuple] = []
        self.failures: list[Exception] = []
        self.closed = False

    def streamed_rows(self, endpoint, request, kind, row_bytes):
        self.asks.append((endpoint, request.layer, request.src_start, request.src_end, kind))
        if self.failures:
            raise self.failures.pop(0)
        return (
            torch.arange(request.src_start, request.src_end, dtype=torch.uint8)
            .repeat_interleave(row_bytes)
            .view(-1, row_bytes)
        )

    def shared_rows(self, region, start, end, row_bytes):
        raise AssertionError("not on the prefill's host")

    def close(self) -> None:
        self.closed = True


def _layout(**kw) -> pb.LayoutMetadata:
    fields = dict(
        model_id="m",
        num_layers=LAYERS,
        block_size=BS,
        prefill_tp_rank=1,
        prefill_tp_size=2,
        data_endpoint="p:1",
        host_id="prefill-host",
        layout_version=VERSION,
        layers=[pb.LayerLayout(layer=i, main_row_bytes=ROW, main_dtype="uint8") for i in range(LAYERS)],
    )
    return pb.LayoutMetadata(**{**fields, **kw})


@pytest.fixture
def consumer():
    c = PullConsumer(BlockSink(), Sources(), model_id="m", read_retries=2)
    assert c.exchange_layout(_layout()) == ""
    yield c
    c.close()
    assert c.sources.closed


def _read(c: PullConsumer, **kw) -> ReadOutcome:
    fields = dict(request_id="r", layer=1, generation=7, src_start=5, src_end=7, dst_start=5, layout_version=VERSION)
    return c.read_ready(pb.ReadReadyRequest(**{**fields, **kw}))


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(layout_version=0), "layout_version: must be > 0"),
        (dict(model_id="other"), "model_id: prefill 'other', decode 'm'"),
        (dict(num_layers=3), "num_layers: prefill 3 (2 described), decode 2"),
        (dict(block_size=8), "block_size: prefill 8, decode 4"),
        (
            dict(layers=[pb.LayerLayout(layer=i, main_row_bytes=ROW, block_size=4 + 4 * i) for i in range(LAYERS)]),
            "layers[1].block_size: prefill 8, decode 4",
        ),
        (
            dict(transfer_engine="mooncake", engine_session="10.0.0.1:1"),
            "transfer_engine: the prefill's transfer_backend is 'mooncake' (session 10.0.0.1:1)",
        ),
        (dict(prefill_tp_rank=4), "prefill_tp_rank: 4 is outside 0..1"),
        (
            dict(layers=[pb.LayerLayout(layer=i, main_row_bytes=ROW + 1) for i in range(LAYERS)]),
            "layers: rows of another size",
        ),
    ],
    ids=["version-0", "model", "layers", "block-size", "layer-block-size", "transfer-backend", "tp", "sink"],
)
def test_the_common_checks_come_first_then_the_sinks(change, reason):
    c = PullConsumer(BlockSink(), Sources(), model_id="m")
    assert c.exchange_layout(_layout(**change)).startswith(reason)
    assert c.layouts() == {}


def test_a_read_is_widened_by_the_sink_installed_and_counted_for_its_prefill_rank(consumer):
    out = _read(consumer)
    assert out.done and out.bytes_read == BS * ROW  # rows [5, 7) widened to their block, [4, 8)
    assert consumer.sources.asks == [("p:1", 1, 4, 8, pb.PLANE_KIND_MAIN)]
    assert consumer.sink.calls == [("begin", 1), ("install", 1, 4, 8, (BS, ROW)), ("end", 1)]
    assert consumer.sink.rows[("r", 1)][:, 0].tolist() == [4, 5, 6, 7]
    snap = consumer.counters.snapshot()
    assert (snap["read_done"], snap["bytes_read"], snap["reads_streamed"]) == (1, out.bytes_read, 1)
    assert snap["bytes_read_prefill_tp_rank_1"] == out.bytes_read


def test_an_answer_from_begin_reads_nothing_and_ends_nothing(consumer):
    assert _read(consumer).done
    consumer.sink.calls.clear()
    again = _read(consumer)
    assert again == ReadOutcome(done=True) and consumer.sink.calls == [("begin", 1)]
    assert len(consumer.sources.asks) == 1 and consumer.counters.snapshot()["read_done"] == 1


def test_a_failed_install_is_answered_failed_told_to_the_sink_and_ended(consumer):
    consumer.sink.fail_install = True
    out = _read(consumer, layer=0)
    assert not out.done and out.reason == (
        "pull of layer 0 rows [5, 7) from p:1 failed: RuntimeError('the request stopped loading')"
    )
    assert consumer.sink.calls[-2:] == [("failed", 0, out.reason), ("end", 0)]
    assert consumer.counters.snapshot()["read_failed"] == 1


def test_retries_stop_once_the_request_no_longer_waits(consumer):
    consumer.sources.failures = [ValueError("short read")] * 2
    assert _read(consumer).done and consumer.counters.snapshot()["read_retries"] == 2
    consumer.sources.failures = [ValueError("short read")]
    consumer.sink.wanted = lambda request_id: False  # it stopped waiting while its read failed
    out = _read(consumer, layer=0)
    assert not out.done and "short read" in out.reason
    assert consumer.counters.snapshot()["read_retries"] == 2  # no retry for the second


@pytest.mark.parametrize(
    "kw, error",
    [
        (dict(layout_version=VERSION + 1), NoAcceptedLayout),
        (dict(layer=LAYERS), MalformedRead),
        (dict(src_start=7, src_end=5), MalformedRead),
        (dict(request_id="nobody"), UnknownRequest),
        (dict(src_end=11), MalformedRead),
    ],
    ids=["layout", "layer", "reversed", "unknown", "past-the-prompt"],
)
def test_a_refused_read_changes_nothing(consumer, kw, error):
    with pytest.raises(error):
        _read(consumer, **kw)
    assert consumer.sources.asks == [] and consumer.counters.snapshot()["read_failed"] == 0


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        raise Aborted(code, details)


def test_the_transfer_servicer_answers_and_aborts_with_each_refusals_status(consumer):
    svc = TransferServicer(consumer)
    ack = svc.ExchangeLayout(_layout(layout_version=VERSION + 1), Context())
    assert ack.accepted and (ack.decode_tp_rank, ack.decode_tp_size, ack.shared_memory) == (0, 1, False)
    done = svc.ReadReady(
        pb.ReadReadyRequest(request_id="r", layer=0, generation=7, src_start=0, src_end=3, layout_version=VERSION),
        Context(),
    )
    assert done.status == pb.READ_DONE and done.bytes_read == BS * ROW
    for request, code in [
        (pb.ReadReadyRequest(request_id="r", layout_version=99), grpc.StatusCode.FAILED_PRECONDITION),
        (pb.ReadReadyRequest(request_id="x", layout_version=VERSION), grpc.StatusCode.NOT_FOUND),
        (pb.ReadReadyRequest(request_id="r", layer=9, layout_version=VERSION), grpc.StatusCode.INVALID_ARGUMENT),
    ]:
        with pytest.raises(Aborted) as e:
            svc.ReadReady(request, Context())
        assert e.value.args[0] == code
    beat = svc.Heartbeat(pb.PrefillHeartbeat(layout_version=VERSION, request_ids=["r", "gone"]), Context())
    assert list(beat.unknown_request_ids) == ["gone"] and svc.counters["heartbeats"] == 1
    assert svc.PrefillDone(pb.PrefillDoneRequest(layout_version=VERSION, request_id="r"), Context()).accepted
    refused = svc.PrefillDone(pb.PrefillDoneRequest(layout_version=VERSION, request_id="q"), Context())
    assert not refused.accepted and refused.reason == "q is not here"


class Rows(RowBuffer):
    def rows(self, request):
        if request.request_id != "r":
            raise UnknownRequest(f"request {request.request_id!r} is not being sent here")
        if request.layout_version != VERSION:
            raise Refused("another layout", grpc.StatusCode.FAILED_PRECONDITION)
        return torch.arange(request.src_start, request.src_end, dtype=torch.uint8)


def test_the_layer_source_streams_the_buffers_rows_and_aborts_with_each_refusals_status():
    svc = LayerSourceServicer(Rows())
    ask = dict(request_id="r", layer=0, kind=pb.PLANE_KIND_MAIN, src_start=2, src_end=6, layout_version=VERSION)
    chunks = list(svc.ReadLayer(pb.ReadLayerRequest(**ask), Context()))
    assert b"".join(c.data for c in chunks) == bytes([2, 3, 4, 5]) and chunks[0].total_bytes == 4
    for change, code, text in [
        (dict(kind=pb.PLANE_KIND_UNSPECIFIED), grpc.StatusCode.INVALID_ARGUMENT, "kind 0"),
        (dict(src_start=6, src_end=2), grpc.StatusCode.INVALID_ARGUMENT, "reversed"),
        (dict(request_id="x"), grpc.StatusCode.NOT_FOUND, "'x'"),
        (dict(layout_version=1), grpc.StatusCode.FAILED_PRECONDITION, "another layout"),
    ]:
        with pytest.raises(Aborted) as e:
            list(svc.ReadLayer(pb.ReadLayerRequest(**{**ask, **change}), Context()))
        assert e.value.args[0] == code and text in e.value.args[1]
