"""Hostile Transfer messages against the real decode control port (``TransferServicer`` over a real
``DecodeLoop`` and ``SparseDecoder``, served on 127.0.0.1): wrong layout metadata, ReadReady for an
unknown request or with out-of-range layer / rows / destination, a generation the prefill no longer
holds, a duplicate ReadReady, PrefillDone for an unknown request, with the wrong prompt length or
before every layer arrived. Each is rejected with a gRPC status or the explicit failure reply the
proto defines, and changes nothing: the request's installed rows, first token, indexer cache, the
host pool, the loop's and the servicer's counters and the accepted layouts are the same afterwards.

The prefill side is a stand-in LayerSource on another loopback port (the cross-host data path): it
streams the rows it was given for (request, layer, generation) and refuses anything else with the
statuses transfer.proto gives LayerSource.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from dsamodel.presets import tiny_model
from kvcore.layout import dtype_name
from kvoffload_decode.loop import DecodeLoop
from kvoffload_decode.transfer import decode_transfer
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder
from kvoffload_engine.model_layout import kv_layout
from kvoffload_proto.v1 import transfer_pb2 as pb
from kvoffload_proto.v1 import transfer_pb2_grpc
from openai_api.sampling_params import SamplingParams

C = grpc.StatusCode
N = 20  # prompt tokens of the request under attack
VERSION = 7
U32_MAX, U64_MAX = 2**32 - 1, 2**64 - 1


class StandInSource(transfer_pb2_grpc.LayerSourceServicer):
    """The prefill's LayerSource contract over rows held in memory: ``rows[(rid, layer, gen)] = (kv, idx)``."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.calls = 0

    def ReadLayer(self, request, context):
        self.calls += 1
        held = self.rows.get((request.request_id, request.layer, request.generation))
        if held is None:
            context.abort(
                C.FAILED_PRECONDITION,
                f"layer {request.layer} of {request.request_id!r} is not at generation {request.generation}",
            )
        plane = held[0] if request.kind == pb.PLANE_KIND_MAIN else held[1]
        if request.src_end > plane.shape[0]:
            context.abort(C.OUT_OF_RANGE, f"rows up to {request.src_end} of {plane.shape[0]}")
        data = plane[request.src_start : request.src_end].contiguous().view(torch.uint8).numpy().tobytes()
        yield pb.DataChunk(offset_bytes=0, data=data, total_bytes=len(data))


class Decode:
    """One decode rank with one pending request ``r`` whose layer 0 already arrived (rows [0, N))."""

    def __init__(self) -> None:
        self.model = tiny_model(dtype="float32")
        c = self.model.config
        self.layout = kv_layout(c, 16, self.model.dtype)
        self.pool = build.decode_pool(self.model, 16, 8 << 20)
        self.loop = DecodeLoop(
            SparseDecoder(self.model, self.pool, topk_buffer_size=64, max_num_seqs=2, max_model_len=256), c.eos_token_id
        )
        self.transfer = decode_transfer(self.loop, self.layout, "tiny", "decode-host")
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        transfer_pb2_grpc.add_TransferServicer_to_server(self.transfer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.source = StandInSource()
        self.source_server = grpc.server(ThreadPoolExecutor(max_workers=4))
        transfer_pb2_grpc.add_LayerSourceServicer_to_server(self.source, self.source_server)
        source_port = self.source_server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.source_server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = transfer_pb2_grpc.TransferStub(self.channel)
        self.layout_pb = pb.LayoutMetadata(
            model_id="tiny",
            num_layers=self.layout.num_layers,
            block_size=16,
            prefill_tp_rank=0,
            prefill_tp_size=1,
            data_endpoint=f"127.0.0.1:{source_port}",
            host_id="prefill-host",
            layout_version=VERSION,
            layers=[
                pb.LayerLayout(
                    layer=s.index,
                    slot=s.index,
                    main_row_bytes=s.main.row_bytes,
                    main_dtype=dtype_name(s.main.dtype),
                    indexer_row_bytes=s.indexer.row_bytes,
                    indexer_dtype=dtype_name(s.indexer.dtype),
                )
                for s in self.layout.layers
            ],
        )
        assert self.stub.ExchangeLayout(self.layout_pb, timeout=10).accepted
        self.events: list = []
        self.loop.expect_remote("r", list(range(N)), SamplingParams(max_tokens=3), lambda *e: self.events.append(e))
        gen = torch.Generator().manual_seed(0)
        for layer in range(self.layout.num_layers):  # generation 1 of every layer holds the prompt's rows
            self.source.rows[("r", layer, 1)] = (
                torch.randn(N, c.kv_row_width, generator=gen),
                torch.randn(N, c.index_head_dim, generator=gen),
            )
        assert self.read(layer=0).status == pb.READ_DONE

    def read(self, **kw) -> pb.ReadResult:
        fields = dict(
            request_id="r", layer=0, generation=1, src_start=0, src_end=N, dst_start=0, layout_version=VERSION
        )
        return self.stub.ReadReady(pb.ReadReadyRequest(**{**fields, **kw}), timeout=30)

    def snapshot(self) -> dict:
        """Everything a hostile message could change."""
        loop = self.loop
        with loop.lock:
            pending = {rid: (list(r.rows), r.first_token, r.copies) for rid, r in loop.pending.items()}
            running = [r.request_id for r in loop.running]
            seqs = {rid: (s.seq_slot, s.num_blocks) for rid, s in loop.decoder.seqs.items()}
            indexer = loop.decoder.indexer.clone()
        pool = self.pool.stats()
        return {
            "pending": pending,
            "running": running,
            "seqs": seqs,
            "indexer": indexer,
            "pool": (pool.used_blocks, pool.used_bytes, pool.live_leases),
            "loop": loop.stats(),
            "counters": {k: v for k, v in self.transfer.counters.items() if k != "read_ms_total"},
            "layouts": {
                v: m.SerializeToString(deterministic=True) for v, m in self.transfer.consumer.layouts().items()
            },
            "events": list(self.events),
        }

    def host_rows(self, layer: int) -> torch.Tensor:
        """The request's main-KV rows [0, N) of ``layer`` as the host pool holds them."""
        dec = self.loop.decoder
        seq = dec.seqs["r"]
        plane = self.pool.plane(dec._planes[layer])  # [num_blocks, block_size, row_bytes]
        ids = dec.block_table[seq.seq_slot, : seq.num_blocks].to(torch.long)
        return plane[ids].reshape(-1, plane.shape[-1])[:N].clone()

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0).wait()
        self.source_server.stop(0).wait()
        self.loop.close()
        self.transfer.close()
        self.pool.close()


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def diff(a: dict, b: dict) -> list[str]:
    return [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]


@pytest.fixture
def decode():
    d = Decode()
    yield d
    d.close()


# ---- ExchangeLayout: wrong layout metadata is refused (accepted=false naming the field) ---------------


def _bad_layout(decode: Decode, change) -> pb.LayoutMetadata:
    m = copy.deepcopy(decode.layout_pb)
    change(m)
    return m


def _set(field: str, value):
    return lambda m: setattr(m, field, value)


def _layer(i: int, field: str, value):
    return lambda m: setattr(m.layers[i], field, value)


LAYOUTS = [
    ("version-zero", _set("layout_version", 0), "layout_version: must be > 0"),
    ("other-model", _set("model_id", "other"), "model_id: prefill 'other', decode 'tiny'"),
    ("fewer-layers", _set("num_layers", 4), "num_layers: prefill 4 (5 described), decode 5"),
    ("layers-not-described", lambda m: m.layers.pop(), "num_layers: prefill 5 (4 described), decode 5"),
    ("huge-num-layers", _set("num_layers", U32_MAX), f"num_layers: prefill {U32_MAX} (5 described), decode 5"),
    ("block-size", _set("block_size", 32), "block_size: prefill 32, decode 16"),
    ("block-size-zero", _set("block_size", 0), "block_size: prefill 0, decode 16"),
    ("tp-size-zero", _set("prefill_tp_size", 0), "tp: prefill tp 0, decode tp 1; prefill TP must be >= decode TP"),
    ("tp-rank-outside", _set("prefill_tp_rank", 2), "prefill_tp_rank: 2 is outside 0..0 (prefill tp 1)"),
    ("main-dtype", _layer(2, "main_dtype", "bfloat16"), "layers[2]: "),
    ("main-row-bytes", _layer(0, "main_row_bytes", 1), "layers[0]: prefill layer 0 rows 1/"),
    ("main-row-kind", _layer(1, "main_row_kind", "k_v"), "layers[1]: the prefill's rows hold 'k_v', this decode's"),
    ("indexer-row-bytes", _layer(4, "indexer_row_bytes", 0), "layers[4]: "),
    ("indexer-dtype", _layer(1, "indexer_dtype", "float16"), "layers[1]: "),
    ("layer-order", _layer(3, "layer", 4), "layers[3]: "),
]


@pytest.mark.parametrize("name, change, reason", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_wrong_layout_metadata_is_refused_and_changes_nothing(decode, name, change, reason):
    before = decode.snapshot()
    for version in (VERSION, 99):  # neither replaces the accepted layout nor adds one
        bad = _bad_layout(decode, change)
        if bad.layout_version:
            bad.layout_version = version
        ack = decode.stub.ExchangeLayout(bad, timeout=10)
        assert not ack.accepted and ack.reason.startswith(reason), ack.reason
    assert same(decode.snapshot(), before), diff(decode.snapshot(), before)
    assert decode.read(layer=1).status == pb.READ_DONE  # the accepted layout still works


# ---- ReadReady: malformed or unknown reads are rejected with a status -----------------------------------

# a table laid out by hand (one case per row): not reformatted
# fmt: off
READS = [
    ("unknown-layout-version", dict(layout_version=8), C.FAILED_PRECONDITION,
     "no accepted layout with layout_version 8"),
    ("layout-version-zero", dict(layout_version=0), C.FAILED_PRECONDITION, "no accepted layout with layout_version 0"),
    ("unknown-request", dict(request_id="nobody", layer=1), C.NOT_FOUND, "request 'nobody' is not waiting for KV here"),
    ("empty-request-id", dict(request_id="", layer=1), C.NOT_FOUND, "request '' is not waiting for KV here"),
    ("layer-past-the-end", dict(layer=5), C.INVALID_ARGUMENT, "layer 5 (0..4)"),
    ("layer-max", dict(layer=U32_MAX), C.INVALID_ARGUMENT, f"layer {U32_MAX} (0..4)"),
    ("reversed-range", dict(layer=1, src_start=10, src_end=4), C.INVALID_ARGUMENT, "range [10, 4) is malformed"),
    ("rows-past-the-prompt", dict(layer=1, src_end=N + 1), C.INVALID_ARGUMENT,
     f"rows [0, {N + 1}) go past the prompt's {N} tokens"),
    ("dst-past-the-prompt", dict(layer=1, src_end=4, dst_start=N - 2), C.INVALID_ARGUMENT,
     f"rows [{N - 2}, {N + 2}) go past the prompt's {N} tokens"),
    ("dst-overflowing", dict(layer=1, src_end=4, dst_start=U64_MAX), C.INVALID_ARGUMENT, "go past the prompt's"),
    ("huge-range", dict(layer=1, src_start=0, src_end=U64_MAX), C.INVALID_ARGUMENT, "go past the prompt's"),
]
# fmt: on


@pytest.mark.parametrize("name, fields, code, text", READS, ids=[x[0] for x in READS])
def test_malformed_read_ready_is_rejected_and_changes_nothing(decode, name, fields, code, text):
    before = decode.snapshot()
    calls = decode.source.calls
    with pytest.raises(grpc.RpcError) as info:
        decode.read(**fields)
    assert info.value.code() == code and text in info.value.details(), info.value.details()
    assert same(decode.snapshot(), before), diff(decode.snapshot(), before)
    assert decode.source.calls == calls  # nothing was pulled


# ---- ReadReady the source cannot serve: READ_FAILED, nothing installed ------------------------------------

# a table laid out by hand (one case per row): not reformatted
# fmt: off
FAILED_READS = [
    ("generation-mismatch", dict(layer=1, generation=2), "FAILED_PRECONDITION"),
    ("generation-zero", dict(layer=1, generation=0), "FAILED_PRECONDITION"),
    ("rows-the-source-does-not-hold", dict(layer=1, request_id="r", src_start=0, src_end=N, generation=1,
                                           _shrink=4), "OUT_OF_RANGE"),
]
# fmt: on


@pytest.mark.parametrize("name, fields, status", FAILED_READS, ids=[x[0] for x in FAILED_READS])
def test_read_the_source_refuses_is_read_failed_and_installs_nothing(decode, name, fields, status):
    fields = dict(fields)
    shrink = fields.pop("_shrink", None)
    if shrink:  # the prefill's buffer holds fewer rows than the ReadReady claims
        kv, idx = decode.source.rows[("r", 1, 1)]
        decode.source.rows[("r", 1, 1)] = (kv[:shrink], idx[:shrink])
    before = decode.snapshot()
    result = decode.read(**fields)
    assert result.status == pb.READ_FAILED and status in result.reason and "layer 1" in result.reason, result.reason
    after = decode.snapshot()
    assert after["counters"]["read_failed"] == before["counters"]["read_failed"] + 1  # the failure is counted
    after["counters"]["read_failed"] = before["counters"]["read_failed"]
    assert same(after, before), diff(after, before)


# ---- duplicates ---------------------------------------------------------------------------------------------


def test_duplicate_read_ready_is_idempotent(decode):
    """transfer.proto: ReadReady is idempotent per (request, layer, generation, attempt); a repeat
    answers READ_DONE again, pulls nothing, counts nothing twice and leaves the installed rows as they were."""
    rows0 = decode.host_rows(0)
    before, calls = decode.snapshot(), decode.source.calls
    for attempt in (0, 1, 0):
        assert decode.read(layer=0, attempt=attempt).status == pb.READ_DONE
        assert decode.read(layer=0, src_start=4, src_end=8, dst_start=4).status == pb.READ_DONE  # a part of it
    assert same(decode.snapshot(), before), diff(decode.snapshot(), before)
    assert decode.source.calls == calls
    assert torch.equal(decode.host_rows(0), rows0)


def test_duplicate_read_ready_with_other_rows_for_an_installed_layer_does_not_overwrite(decode):
    """A repeat for layer 0 whose source now holds other bytes (a hostile or stale slot) must not
    replace the rows the request already has."""
    rows0 = decode.host_rows(0)
    kv, idx = decode.source.rows[("r", 0, 1)]
    decode.source.rows[("r", 0, 2)] = (kv + 1, idx + 1)
    before = decode.snapshot()
    result = decode.read(layer=0, generation=2)
    assert result.status == pb.READ_DONE
    assert torch.equal(decode.host_rows(0), rows0)
    assert torch.equal(decode.snapshot()["indexer"], before["indexer"])


# ---- PrefillDone -------------------------------------------------------------------------------------------


def _done(decode: Decode, **kw) -> pb.PrefillDoneReply:
    fields = dict(request_id="r", num_prompt_tokens=N, first_token=7, layout_version=VERSION)
    return decode.stub.PrefillDone(pb.PrefillDoneRequest(**{**fields, **kw}), timeout=10)


def test_prefill_done_for_an_unknown_request_is_not_found(decode):
    before = decode.snapshot()
    with pytest.raises(grpc.RpcError) as info:
        _done(decode, request_id="nobody")
    assert info.value.code() == C.NOT_FOUND and "request 'nobody' is not waiting for KV here" in info.value.details()
    assert same(decode.snapshot(), before)


@pytest.mark.parametrize("tokens", [N - 1, N + 1, 0, U32_MAX])
def test_prefill_done_with_the_wrong_prompt_length_is_refused(decode, tokens):
    for layer in range(1, decode.layout.num_layers):
        assert decode.read(layer=layer).status == pb.READ_DONE
    before = decode.snapshot()
    reply = _done(decode, num_prompt_tokens=tokens)
    assert not reply.accepted and reply.reason == f"prefill had {tokens} prompt tokens, the decode request {N}"
    assert same(decode.snapshot(), before), diff(decode.snapshot(), before)


def test_prefill_done_before_every_layer_arrived_is_refused(decode):
    """transfer.proto: PrefillDone means every layer was announced (and the prefill waited for every
    READ_DONE); the decode refuses one that comes early, naming the missing layer, and keeps no
    first token from it — else the request would start decoding from a token it must not trust."""
    before = decode.snapshot()
    reply = _done(decode)
    assert not reply.accepted and reply.reason == (
        f"layer 1 has 0 of {N} rows: PrefillDone must follow every layer's READ_DONE"
    ), reply.reason
    assert same(decode.snapshot(), before), diff(decode.snapshot(), before)
    for layer in range(1, decode.layout.num_layers):  # then the real transfer completes and decodes
        assert decode.read(layer=layer).status == pb.READ_DONE
    finished = threading.Event()
    decode.loop.lock.acquire()
    decode.events.clear()
    decode.loop.lock.release()
    reply = _done(decode, first_token=5)
    assert reply.accepted, reply.reason
    for _ in range(300):
        if any(e[0] in ("done", "error") for e in list(decode.events)):
            finished.set()
            break
        threading.Event().wait(0.1)
    assert finished.is_set()
    tokens = [v for k, v in decode.events if k == "token"]
    assert tokens[0] == 5 and decode.events[-1] == ("done", "length")


def test_a_second_prefill_done_with_another_first_token_does_not_replace_it(decode):
    for layer in range(1, decode.layout.num_layers):
        assert decode.read(layer=layer).status == pb.READ_DONE
    decode.loop._admit_ready = lambda: None  # keep the request pending between the two calls
    assert _done(decode, first_token=5).accepted
    second = _done(decode, first_token=9)
    assert not second.accepted and second.reason == "the first token is already 5 (this PrefillDone says 9)"
    assert decode.loop.pending["r"].first_token == 5
    assert _done(decode, first_token=5).accepted  # the same report again is harmless


def test_prefill_done_without_an_accepted_layout_is_refused(decode):
    for layer in range(1, decode.layout.num_layers):
        assert decode.read(layer=layer).status == pb.READ_DONE
    before = decode.snapshot()
    with pytest.raises(grpc.RpcError) as info:
        _done(decode, layout_version=8)
    assert info.value.code() == C.FAILED_PRECONDITION
    assert "no accepted layout with layout_version 8" in info.value.details()
    assert same(decode.snapshot(), before), diff(decode.snapshot(), before)
