"""Hostile ReadLayer calls against the real prefill LayerSource (``LayerSourceServicer`` over a real
``LayerwisePrefill`` of the tiny model, served on 127.0.0.1): a wrong layout version, a layer out of
range, a malformed or out-of-range row range, a plane kind that does not exist, a generation the slot
no longer holds, a layer whose slot was reused, a request that is not the slot's reader. Each is
refused with the status transfer.proto gives LayerSource and changes nothing: the gates' counters,
the slot tickets and the buffer bytes are the same afterwards, and the legitimate read still works."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from dsamodel.presets import tiny_model
from kvoffload_engine import build
from kvoffload_engine.prefill import PrefillRequest
from kvoffload_prefill.source import LayerBufferRows
from kvoffload_proto.v1 import transfer_pb2 as pb
from kvoffload_proto.v1 import transfer_pb2_grpc
from pdlink.layer_source import LayerSourceServicer

C = grpc.StatusCode
VERSION = 11
P = 40  # prompt tokens
READER = ("r", "decode:1")
U32_MAX, U64_MAX = 2**32 - 1, 2**64 - 1


class Prefill:
    """A prefill that computed request ``r`` for one reader; layer 4's read is still pending, so its
    slot (shared with layer 1, which it replaced) holds layer 4 at a known generation."""

    def __init__(self) -> None:
        model = tiny_model(dtype="float32")
        self.pool = build.prefill_pool(model, 16, 8 << 20)
        self.engine = build.prefill_engine(
            model,
            self.pool,
            buffers=3,
            independent=[0],
            chunk_size=64,
            max_model_len=256,
            model_id="tiny",
            buffer_segment=f"kvoffload-test-{uuid.uuid4().hex[:8]}",
            gate_timeout_s=30,
        )
        self.held = {}

        def announce(ticket, req, start, end):
            if ticket.layer == 4:
                self.held[4] = ticket  # its reader has not answered yet: the slot keeps the rows
            else:
                ticket.read_done(READER)

        self.engine.announce = announce
        self.result = self.engine.run(PrefillRequest("r", torch.arange(P) % 200, readers=frozenset({READER})))
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        transfer_pb2_grpc.add_LayerSourceServicer_to_server(
            LayerSourceServicer(LayerBufferRows(self.engine, {VERSION: self.engine.buffers})), self.server
        )
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = transfer_pb2_grpc.LayerSourceStub(self.channel)
        self.generation = self.engine.gates.ticket(4).generation

    def read(self, **kw) -> bytes:
        fields = dict(
            request_id="r",
            layer=4,
            kind=pb.PLANE_KIND_MAIN,
            src_start=0,
            src_end=P,
            generation=self.generation,
            layout_version=VERSION,
        )
        chunks = list(self.stub.ReadLayer(pb.ReadLayerRequest(**{**fields, **kw}), timeout=10))
        return b"".join(c.data for c in chunks)

    def snapshot(self) -> dict:
        eng = self.engine
        tickets = {}
        for layer in range(5):
            try:
                t = eng.gates.ticket(layer)
                tickets[layer] = (t.generation, t.is_settled, t.pending())
            except ValueError as exc:
                tickets[layer] = str(exc)
        return {
            "gates": eng.gates.stats(),
            "tickets": tickets,
            "main": {slot: eng.buffers.main(layer).clone() for slot, layer in ((0, 0), (1, 4), (2, 2), (3, 3))},
            "pool": self.pool.stats(),
        }

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0).wait()
        if 4 in self.held:
            self.held[4].read_done(READER)
        self.engine.release(self.result)
        self.engine.close()
        self.pool.close()


@pytest.fixture(scope="module")
def prefill():
    p = Prefill()
    yield p
    p.close()


def same(a: dict, b: dict) -> bool:
    return (
        a["gates"] == b["gates"]
        and a["tickets"] == b["tickets"]
        and a["pool"] == b["pool"]
        and all(torch.equal(a["main"][k], b["main"][k]) for k in a["main"])
    )


def test_the_legitimate_read_streams_the_rows(prefill):
    main = prefill.read()
    assert main == prefill.engine.buffers.main(4)[:P].contiguous().view(torch.uint8).numpy().tobytes()
    idx = prefill.read(kind=pb.PLANE_KIND_INDEXER, src_start=8, src_end=24)
    assert idx == prefill.engine.buffers.indexer(4)[8:24].contiguous().view(torch.uint8).numpy().tobytes()
    assert prefill.read(src_start=5, src_end=5) == b""


HOSTILE = [
    (
        "other-layout-version",
        dict(layout_version=12),
        C.FAILED_PRECONDITION,
        "layout_version 12 is not one of this prefill's",
    ),
    (
        "layout-version-zero",
        dict(layout_version=0),
        C.FAILED_PRECONDITION,
        "layout_version 0 is not one of this prefill's",
    ),
    ("layer-past-the-end", dict(layer=5), C.INVALID_ARGUMENT, "layer 5"),
    ("layer-max", dict(layer=U32_MAX), C.INVALID_ARGUMENT, f"layer {U32_MAX}"),
    ("reversed-range", dict(src_start=9, src_end=3), C.INVALID_ARGUMENT, "range [9, 3) is reversed"),
    ("kind-unspecified", dict(kind=pb.PLANE_KIND_UNSPECIFIED), C.INVALID_ARGUMENT, "kind"),
    ("kind-unknown-value", dict(kind=7), C.INVALID_ARGUMENT, "kind"),
    ("slot-reused-by-another-layer", dict(layer=1), C.FAILED_PRECONDITION, "layer 1 is not the current occupant"),
    ("stale-generation", dict(generation=0), C.FAILED_PRECONDITION, "not 0"),
    ("future-generation", dict(generation=U64_MAX), C.FAILED_PRECONDITION, f"not {U64_MAX}"),
    ("not-the-slot-reader", dict(request_id="someone-else"), C.NOT_FOUND, "'someone-else'"),
    ("rows-past-the-buffer", dict(src_end=10**9), C.OUT_OF_RANGE, "rows up to 1000000000"),
    ("rows-max", dict(src_start=0, src_end=U64_MAX), C.OUT_OF_RANGE, f"rows up to {U64_MAX}"),
]


@pytest.mark.parametrize("name, fields, code, text", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_read_layer_is_refused_and_changes_nothing(prefill, name, fields, code, text):
    before = prefill.snapshot()
    with pytest.raises(grpc.RpcError) as info:
        prefill.read(**fields)
    assert info.value.code() == code and text in info.value.details(), (info.value.code(), info.value.details())
    assert same(prefill.snapshot(), before)
    assert (
        prefill.read(src_end=4) == prefill.engine.buffers.main(4)[:4].contiguous().view(torch.uint8).numpy().tobytes()
    )


def test_undecodable_bytes_are_refused(prefill):
    call = prefill.channel.unary_stream(
        "/kvoffload.v1.LayerSource/ReadLayer",
        request_serializer=lambda b: b,
        response_deserializer=pb.DataChunk.FromString,
    )
    before = prefill.snapshot()
    with pytest.raises(grpc.RpcError) as info:
        list(call(b"\x0a\xff\xff\xff\xff\x0f", timeout=10))
    assert info.value.code() != C.OK
    assert same(prefill.snapshot(), before)
