"""The decode's pull path without a gRPC server: ``pdlink``'s ``PullConsumer`` over the decode's
``DecodeRows`` (``kvoffload_decode.pull``), a real ``DecodeLoop`` and ``SparseDecoder``, with
stand-in row sources or ``pdlink``'s ``RowSources`` over a real shared-memory segment. (``RowSources``
and ``PullCounters`` on their own: libs/pdlink/tests; the harness: support/pull_support.py.)

What ``test_transfer_hostile`` covers through the real control port (layout reasons, malformed
ReadReady, a source's refusals, duplicates, PrefillDone) is not repeated here; this file covers
retries, the shared-memory path, concurrent pulls and the counters themselves (layouts, heartbeats
and PrefillDone: test_pull_layouts).
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from pull_support import HOST, VERSION, N, Rank, counts, rank  # noqa: F401  (rank: fixture)

from dsamodel.presets import tiny_model
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.segment import SharedSegment
from kvoffload_decode.transfer import decode_transfer
from kvoffload_engine.model_layout import kv_layout
from pdlink.pullcounters import COUNTERS
from pdlink.refusals import MalformedRead, NoAcceptedLayout, UnknownRequest
from pdlink.sources import PERMANENT, RowSources

STATS_KEYS = {
    "read_done",
    "read_failed",
    "read_retries",
    "bytes_read",
    "read_ms_total",
    "reads_shared_memory",
    "reads_streamed",
    "reads_engine",
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
