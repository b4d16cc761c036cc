"""The decode's pull path without a gRPC server: ``pdlink``'s ``PullConsumer`` over the decode's
``DecodeRows`` (``kvoffload_decode.pull``), a real ``DecodeLoop`` and ``SparseDecoder``, with
stand-in row sources or ``pdlink``'s ``RowSources`` over a real shared-memory segment. (``RowSources``
and ``PullCounters`` on their own: libs/pdlink/tests.)

What ``test_transfer_hostile`` covers through the real control port (layout reasons, malformed
ReadReady, a source's refusals, duplicates, PrefillDone) is not repeated here; this file covers
retries, the shared-memory path, heartbeats, concurrent pulls and the counters themselves.
"""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from dsamodel.presets import tiny_model
from kvcore.layout import dtype_name
from kvcore.poolgeometry import PoolGeometry
from kvcore.segment import SharedSegment
from kvoffload_decode.loop import DecodeLoop
from kvoffload_decode.pull import DecodeRows
from kvoffload_decode.transfer import decode_transfer
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder
from kvoffload_engine.layout import kv_layout
from kvoffload_proto.v1 import transfer_pb2 as pb
from openai_api.sampling_params import SamplingParams
from pdlink.consumer import PullConsumer, ReadOutcome
from pdlink.pullcounters import COUNTERS
from pdlink.refusals import MalformedRead, NoAcceptedLayout, UnknownRequest
from pdlink.sources import PERMANENT, RowSources

N = 20  # prompt tokens of each request
VERSION = 3
HOST = "decode-host"
STATS_KEYS = {
    "read_done",
    "read_failed",
    "read_retries",
    "bytes_read",
    "read_ms_total",
    "reads_shared_memory",
    "reads_streamed",
    "heartbeats",
}  # what Stats, /metrics and the kvoffload tools read


def test_the_servicer_exposes_a_snapshot_under_the_names_stats_and_metrics_read():
    assert set(COUNTERS) == STATS_KEYS
    model = tiny_model(dtype="float32")
    transfer = decode_transfer(None, kv_layout(model.config, 16, model.dtype), "tiny", HOST)
    counters = transfer.counters
    assert set(counters) == STATS_KEYS
    counters["read_done"] = 5
    assert transfer.counters["read_done"] == 0
    transfer.close()


# ---- the pulls into a real DecodeLoop, stand-in sources ----------------------------------------------


class Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class FakeSources:
    """``RowSources``' contract over rows in memory; raises the queued ``failures`` first (one per plane read)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.failures: list[Exception] = []
        self.calls = 0
        self.closed = False
        self.on_read = lambda: None
        self._lock = threading.Lock()

    def streamed_rows(self, endpoint, request, kind, row_bytes):
        with self._lock:
            self.calls += 1
            failure = self.failures.pop(0) if self.failures else None
        self.on_read()
        if failure is not None:
            raise failure
        kv, idx = self.rows[(request.request_id, request.layer)]
        plane = kv if kind == pb.PLANE_KIND_MAIN else idx
        out = plane[request.src_start : request.src_end].contiguous().view(torch.uint8)
        assert out.shape[1] == row_bytes
        return out

    def shared_rows(self, region, start, end, row_bytes):
        raise AssertionError("the stand-in prefill is on another host")

    def close(self) -> None:
        self.closed = True


class Rank:
    """A decode rank's loop with ``requests`` pending requests (``r0``, ``r1``, ...) and a puller."""

    def __init__(
        self,
        requests: int = 1,
        read_retries: int = 2,
        sources=None,
        host_id: str = "prefill-host",
        max_num_seqs: int = 2,
    ) -> None:
        self.model = tiny_model(dtype="float32")
        c = self.model.config
        self.layout = kv_layout(c, 16, self.model.dtype)
        self.pool = build.decode_pool(self.model, 16, 16 << 20)
        self.loop = DecodeLoop(
            SparseDecoder(self.model, self.pool, topk_buffer_size=64, max_num_seqs=max_num_seqs, max_model_len=256),
            c.eos_token_id,
        )
        self.sources = sources if sources is not None else FakeSources()
        self.puller = PullConsumer(
            DecodeRows(self.loop, self.layout), self.sources, model_id="tiny", host_id=HOST, read_retries=read_retries
        )
        self.meta = pb.LayoutMetadata(
            model_id="tiny",
            num_layers=self.layout.num_layers,
            block_size=16,
            prefill_tp_rank=0,
            prefill_tp_size=1,
            data_endpoint="prefill:1",
            host_id=host_id,
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
        gen = torch.Generator().manual_seed(0)
        for i in range(requests):
            self.loop.expect_remote(f"r{i}", list(range(N)), SamplingParams(max_tokens=3), lambda *e: None)
            for layer in range(self.layout.num_layers):
                if isinstance(self.sources, FakeSources):
                    self.sources.rows[(f"r{i}", layer)] = (
                        torch.randn(N, c.kv_row_width, generator=gen),
                        torch.randn(N, c.index_head_dim, generator=gen),
                    )

    def accept(self) -> None:
        assert self.puller.exchange_layout(self.meta) == ""

    def read(self, **kw) -> ReadOutcome:
        fields = dict(
            request_id="r0", layer=0, generation=1, src_start=0, src_end=N, dst_start=0, layout_version=VERSION
        )
        return self.puller.read_ready(pb.ReadReadyRequest(**{**fields, **kw}))

    def rows(self, request_id: str, layer: int) -> int:
        with self.loop.lock:
            return self.loop.pending[request_id].rows[layer]

    def host_rows(self, request_id: str, layer: int) -> torch.Tensor:
        """The request's main-KV rows [0, N) of ``layer`` as the host pool holds them (as the model dtype)."""
        dec = self.loop.decoder
        seq = dec.seqs[request_id]
        plane = self.pool.plane(dec._planes[layer])  # [num_blocks, block_size, row_bytes]
        ids = dec.block_table[seq.seq_slot, : seq.num_blocks].to(torch.long)
        return plane[ids].reshape(-1, plane.shape[-1])[:N].clone().view(self.model.dtype)

    def close(self) -> None:
        self.loop.close()
        self.puller.close()
        self.pool.close()


@pytest.fixture
def rank():
    r = Rank()
    r.accept()
    yield r
    r.close()


def counts(rank: Rank, *names: str) -> dict:
    snap = rank.puller.counters.snapshot()
    return {k: snap[k] for k in names}


def test_a_pull_installs_the_rows_and_counts_them(rank):
    out = rank.read(layer=2)
    kv, idx = rank.sources.rows[("r0", 2)]
    assert out.done and out.reason == "" and out.read_ms >= 0
    assert out.bytes_read == kv.numel() * 4 + idx.numel() * 4
    assert rank.rows("r0", 2) == N
    assert torch.equal(rank.host_rows("r0", 2), kv)
    assert counts(rank, "read_done", "bytes_read", "reads_streamed", "reads_shared_memory") == {
        "read_done": 1,
        "bytes_read": out.bytes_read,
        "reads_streamed": 2,
        "reads_shared_memory": 0,
    }


def test_a_refused_read_ready_raises_its_type_and_pulls_nothing(rank):
    for fields, error in [
        (dict(layout_version=VERSION + 1), NoAcceptedLayout),
        (dict(layer=99), MalformedRead),
        (dict(request_id="nobody"), UnknownRequest),
        (dict(dst_start=1), MalformedRead),
    ]:
        with pytest.raises(error):
            rank.read(**fields)
    assert rank.sources.calls == 0 and rank.puller.counters.snapshot() == dict.fromkeys(STATS_KEYS, 0)


def test_a_duplicate_is_answered_from_the_installed_rows():
    r = Rank()
    r.accept()
    try:
        first = r.read(layer=1)
        calls, before = r.sources.calls, r.puller.counters.snapshot()
        again = r.read(layer=1, src_start=2, src_end=5, dst_start=2)  # a part of what is installed
        assert again.done and (again.bytes_read, again.read_ms) == (0, 0.0) and first.bytes_read > 0
        assert r.sources.calls == calls and r.puller.counters.snapshot() == before
    finally:
        r.close()


@pytest.mark.parametrize(
    "failure", [ValueError("short read"), Rpc(grpc.StatusCode.UNAVAILABLE)], ids=["short-read", "unavailable"]
)
def test_a_transient_failure_is_retried_and_counted(rank, failure):
    rank.sources.failures = [failure, failure]  # the first two plane reads fail
    out = rank.read(layer=1)
    assert out.done and rank.rows("r0", 1) == N
    assert counts(rank, "read_retries", "read_done", "read_failed") == {
        "read_retries": 2,
        "read_done": 1,
        "read_failed": 0,
    }


def test_retries_run_out_into_a_failed_answer():
    r = Rank(read_retries=1)
    r.accept()
    try:
        r.sources.failures = [ValueError("short read")] * 5
        out = r.read(layer=1)
        assert (
            not out.done
            and "pull of layer 1 rows [0, 20) from prefill:1 failed: ValueError('short read')" == out.reason
        )
        assert r.sources.calls == 2  # one try, one retry
        assert counts(r, "read_retries", "read_failed", "read_done") == {
            "read_retries": 1,
            "read_failed": 1,
            "read_done": 0,
        }
        assert r.rows("r0", 1) == 0
    finally:
        r.close()


@pytest.mark.parametrize("code", PERMANENT, ids=[c.name for c in PERMANENT])
def test_a_permanent_refusal_of_the_source_is_not_retried(rank, code):
    rank.sources.failures = [Rpc(code)]
    out = rank.read(layer=1)
    assert not out.done and code.name in out.reason
    assert rank.sources.calls == 1
    assert counts(rank, "read_retries", "read_failed") == {"read_retries": 0, "read_failed": 1}


def test_no_retry_for_a_request_that_stopped_waiting(rank):
    rank.sources.failures = [ValueError("short read")] * 3
    rank.sources.on_read = lambda: rank.loop.cancel("r0", "client went away")
    out = rank.read(layer=1)
    assert not out.done and rank.sources.calls == 1
    assert counts(rank, "read_retries", "read_failed") == {"read_retries": 0, "read_failed": 1}


def test_concurrent_pulls_count_exactly():
    """Many ReadReady at once (as from the 16 control-port threads): every layer of every request
    is installed once and the counters add up."""
    r = Rank(requests=4, max_num_seqs=4)
    r.accept()
    try:
        work = [(f"r{i}", layer) for i in range(4) for layer in range(r.layout.num_layers)]
        with ThreadPoolExecutor(16) as ex:
            outs = list(ex.map(lambda w: r.read(request_id=w[0], layer=w[1]), work))
        assert all(o.done for o in outs)
        per_pull = outs[0].bytes_read
        assert counts(r, "read_done", "bytes_read", "reads_streamed", "read_failed") == {
            "read_done": len(work),
            "bytes_read": per_pull * len(work),
            "reads_streamed": 2 * len(work),
            "read_failed": 0,
        }
        assert all(r.rows(rid, layer) == N for rid, layer in work)
    finally:
        r.close()


# ---- layouts, heartbeats, PrefillDone -------------------------------------------------------------------


def test_layouts_are_kept_by_version_and_handed_out_as_a_copy(rank):
    assert rank.puller.accepted_layout(VERSION) is rank.meta
    copy = rank.puller.layouts()
    copy.clear()
    assert set(rank.puller.layouts()) == {VERSION}
    bad = pb.LayoutMetadata()
    bad.CopyFrom(rank.meta)
    bad.model_id = "other"
    assert rank.puller.exchange_layout(bad) == "model_id: prefill 'other', decode 'tiny'"
    assert rank.puller.accepted_layout(VERSION) is rank.meta  # a refused layout replaces nothing
    with pytest.raises(NoAcceptedLayout, match="no accepted layout with layout_version 4"):
        rank.puller.accepted_layout(4)
    assert not rank.puller.same_host(rank.meta.host_id) and rank.puller.same_host(HOST)


def test_a_decode_tp_rank_accepts_only_the_layouts_of_its_contributors(rank):
    """Decode TP rank 1 of 2 takes layouts from prefill TP ranks 2 and 3 of 4 (its contributor group)
    and refuses every other rank and any prefill TP that cannot feed decode TP 2, naming both sides."""
    rank.puller.tp_rank, rank.puller.tp_size = 1, 2
    m = pb.LayoutMetadata()
    m.CopyFrom(rank.meta)
    for p_tp, p_rank, want in [
        (4, 2, ""),
        (4, 3, ""),
        (2, 1, ""),
        (4, 1, "tp rank: prefill tp rank 1 of 4 feeds decode tp rank 0 of 2, not decode tp rank 1"),
        (1, 0, "tp: prefill tp 1, decode tp 2; prefill TP must be >= decode TP"),
        (3, 2, "tp: prefill tp 3, decode tp 2; prefill TP must be >= decode TP and divisible"),
    ]:
        m.prefill_tp_size, m.prefill_tp_rank, m.layout_version = p_tp, p_rank, VERSION + 10 + p_tp * 4 + p_rank
        reason = rank.puller.exchange_layout(m)
        assert reason.startswith(want) if want else reason == "", (p_tp, p_rank, reason)


def test_two_contributors_shares_of_every_layer_complete_the_prompt_and_are_counted_by_rank(rank):
    """Prefill TP ranks 0 and 1 of 2 feed this decode rank (TP 1): each sends its share of every layer,
    rank 1's first. The prompt is whole, the host pool holds the prefill's rows, and the bytes each
    rank's share carried sum to one copy of the prompt's KV."""
    m = pb.LayoutMetadata()
    m.CopyFrom(rank.meta)
    rank.meta.prefill_tp_size = 2
    assert rank.puller.exchange_layout(rank.meta) == ""
    m.prefill_tp_size, m.prefill_tp_rank, m.layout_version = 2, 1, VERSION + 1
    assert rank.puller.exchange_layout(m) == ""
    cut = 13
    for layer in range(rank.layout.num_layers):
        assert rank.read(layer=layer, src_start=cut, dst_start=cut, layout_version=VERSION + 1).done
        assert rank.rows("r0", layer) == 0
        assert rank.read(layer=layer, src_end=cut).done
        assert rank.rows("r0", layer) == N
        assert torch.equal(rank.host_rows("r0", layer), rank.sources.rows[("r0", layer)][0])
    snap = rank.puller.counters.snapshot()
    one_copy = sum(
        (kv.numel() + idx.numel()) * 4
        for kv, idx in (rank.sources.rows[("r0", i)] for i in range(rank.layout.num_layers))
    )
    assert snap["bytes_read"] == one_copy
    assert snap["bytes_read_prefill_tp_rank_0"] == one_copy * cut // N
    assert snap["bytes_read_prefill_tp_rank_1"] == one_copy * (N - cut) // N


def test_heartbeat_names_the_unknown_requests_and_is_counted(rank):
    assert rank.puller.heartbeat(VERSION, ["r0", "gone", "r0"]) == ["gone"]
    assert rank.loop.ledger.stage_of("r0") == "pulling"  # the prefill has been heard from
    with pytest.raises(NoAcceptedLayout):
        rank.puller.heartbeat(VERSION + 1, ["r0"])
    assert counts(rank, "heartbeats") == {"heartbeats": 1}


def test_prefill_done_for_an_unknown_request_raises(rank):
    with pytest.raises(UnknownRequest, match="request 'nobody' is not waiting for KV here"):
        rank.puller.prefill_done(
            pb.PrefillDoneRequest(layout_version=VERSION, request_id="nobody", num_prompt_tokens=N, first_token=7)
        )


# ---- the shared-memory path through RowSources ----------------------------------------------------------


@pytest.fixture
def prefill_segment(rank):
    """The prefill's layer buffer in shared memory: planes (layer, main|indexer), rows [0, 32)."""
    specs = rank.layout.layers
    labels = tuple((s.index, kind) for s in specs for kind in ("main", "indexer"))
    row_bytes = tuple(c.row_bytes for s in specs for c in (s.main, s.indexer))
    seg = SharedSegment.create(f"test-pull-{uuid.uuid4().hex[:8]}", PoolGeometry(16, row_bytes, 2, labels))
    for p, (layer, kind) in enumerate(labels):
        kv, idx = rank.sources.rows[("r0", layer)]
        seg.plane(p).view(-1, row_bytes[p])[:N] = (kv if kind == "main" else idx).view(torch.uint8)
    yield seg, labels
    seg.close()
    seg.unlink()


def _same_host(rank: Rank, seg: SharedSegment, labels, capacity: int = 32) -> Rank:
    """A rank whose puller reads the segment through real ``RowSources``, the prefill on its host."""
    shared = Rank(sources=RowSources(lambda endpoint: pytest.fail(f"streamed from {endpoint}")), host_id=HOST)
    for p, (layer, kind) in enumerate(labels):
        lay = shared.meta.layers[layer]
        region = lay.main_buffer if kind == "main" else lay.indexer_buffer
        region.segment_name, region.offset_bytes = seg.name, seg.plane_offsets[p]
        region.row_stride_bytes = seg.geometry.plane_row_bytes[p]
        region.capacity_tokens = capacity
    shared.accept()
    return shared


def test_same_host_rows_come_out_of_the_shared_segment_attached_once(rank, prefill_segment, monkeypatch):
    seg, labels = prefill_segment
    attached = []
    real_attach = SharedSegment.attach
    monkeypatch.setattr(
        SharedSegment, "attach", classmethod(lambda cls, name: attached.append(real_attach(name)) or attached[-1])
    )
    shared = _same_host(rank, seg, labels)
    try:
        for layer in (0, 3):
            out = shared.read(layer=layer)
            assert out.done, out.reason
            assert torch.equal(shared.host_rows("r0", layer), rank.sources.rows[("r0", layer)][0])
        assert len(attached) == 1  # one attach for every plane of the segment
        assert counts(shared, "reads_shared_memory", "reads_streamed", "read_done") == {
            "reads_shared_memory": 4,
            "reads_streamed": 0,
            "read_done": 2,
        }
    finally:
        shared.close()
    assert attached[0].closed  # close() lets go of the attached segment


def test_a_region_too_small_for_the_rows_fails_the_read(rank, prefill_segment):
    seg, labels = prefill_segment
    shared = _same_host(rank, seg, labels, capacity=N - 1)
    try:
        out = shared.read(layer=1)
        assert not out.done and "cannot give rows [0, 20)" in out.reason
        assert counts(shared, "read_retries", "read_failed", "reads_shared_memory") == {
            "read_retries": 2,
            "read_failed": 1,
            "reads_shared_memory": 0,
        }
        assert shared.rows("r0", 1) == 0
    finally:
        shared.close()
