"""``RowSources`` on its own: rows streamed from a LayerSource (a stand-in channel) assembled from
their chunks, one channel per endpoint, chunks that do not add up, and the release of attached
segments whose producer is gone. (The shared-memory path under a real puller: services/decode's
test_pull.)"""

from __future__ import annotations

import re
import uuid

import grpc
import pytest

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.segment import SharedSegment
from kvoffload_proto.v1 import transfer_pb2 as pb
from pdlink.sources import RowSources

VERSION = 3


class FakeChannel:
    """Answers every ReadLayer with ``chunks``; records the requests."""

    def __init__(self, chunks) -> None:
        self.chunks, self.requests, self.closed = chunks, [], False

    def unary_stream(self, method, **kw):
        assert method == "/kvoffload.v1.LayerSource/ReadLayer"

        def call(request, timeout=None):
            self.requests.append(request)
            return iter(self.chunks)

        return call

    def close(self) -> None:
        self.closed = True


def _stream(chunks, rows: int = 2, row_bytes: int = 4):
    channels = []
    sources = RowSources(lambda endpoint: channels.append(FakeChannel(chunks)) or channels[-1])
    req = pb.ReadReadyRequest(
        request_id="r", layer=1, src_start=3, src_end=3 + rows, generation=2, layout_version=VERSION
    )
    return sources, channels, lambda: sources.streamed_rows("p:1", req, pb.PLANE_KIND_INDEXER, row_bytes)


def test_streamed_rows_are_assembled_from_chunks_over_one_channel_per_endpoint():
    data = bytes(range(8))
    sources, channels, read = _stream(
        [
            pb.DataChunk(offset_bytes=4, data=data[4:], total_bytes=8),
            pb.DataChunk(offset_bytes=0, data=data[:4], total_bytes=8),
        ]
    )
    assert read().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    read()
    assert len(channels) == 1 and len(channels[0].requests) == 2
    sent = channels[0].requests[0]
    assert (
        sent.request_id,
        sent.layer,
        sent.kind,
        sent.src_start,
        sent.src_end,
        sent.generation,
        sent.layout_version,
    ) == ("r", 1, pb.PLANE_KIND_INDEXER, 3, 5, 2, VERSION)
    sources.close()
    assert channels[0].closed


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([pb.DataChunk(offset_bytes=0, data=bytes(4), total_bytes=8)], "LayerSource sent 4 of 8 bytes"),
        ([pb.DataChunk(offset_bytes=0, data=bytes(8), total_bytes=16)], "does not fit 8 bytes"),
        ([pb.DataChunk(offset_bytes=6, data=bytes(4), total_bytes=8)], "chunk at 6 (+4) does not fit 8 bytes"),
    ],
    ids=["short", "wrong-total", "past-the-end"],
)
def test_chunks_that_do_not_add_up_are_a_value_error(chunks, message):
    sources, _, read = _stream(chunks)
    with pytest.raises(ValueError, match=re.escape(message)):
        read()
    sources.close()


def test_attaching_a_new_prefill_segment_lets_go_of_those_whose_prefill_is_gone():
    """A prefill restarted under a new segment name: the decode's mapping of the old one (memory the
    kernel cannot free while mapped) is released when it attaches the new one; a live one is kept."""
    geometry = PoolGeometry(4, (8,), 2)
    sources = RowSources(lambda endpoint: pytest.fail(f"streamed from {endpoint}"))

    def region(seg):
        return pb.BufferRegion(
            segment_name=seg.name, offset_bytes=seg.plane_offsets[0], row_stride_bytes=8, capacity_tokens=8
        )

    old, live, new = (SharedSegment.create(f"test-rows-{uuid.uuid4().hex[:12]}", geometry) for _ in range(3))
    try:
        sources.shared_rows(region(old), 0, 2, 8)
        sources.shared_rows(region(live), 0, 2, 8)
        attached = dict(sources._segments)
        old.close()
        old.unlink()  # the prefill exited
        sources.shared_rows(region(new), 0, 2, 8)
        assert set(sources._segments) == {live.name, new.name}
        assert attached[old.name].closed and not attached[live.name].closed
    finally:
        sources.close()
        for seg in (live, new):
            seg.close()
            seg.unlink()


class _Code(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


def test_read_with_retries_retries_what_a_retry_can_change_and_nothing_else(monkeypatch):
    import pdlink.sources as sources

    monkeypatch.setattr(sources.time, "sleep", lambda s: None)
    retried = []

    def flaky(errors):
        def read():
            if errors:
                raise errors.pop(0)
            return "rows"

        return read

    on_retry = lambda attempt, exc: retried.append(attempt)  # noqa: E731
    assert (
        sources.read_with_retries(
            flaky([ValueError("short"), _Code(grpc.StatusCode.UNAVAILABLE)]), 2, lambda: True, on_retry
        )
        == "rows"
    )
    assert retried == [1, 2]
    for code in sources.PERMANENT:  # a permanent refusal: no retry
        with pytest.raises(grpc.RpcError):
            sources.read_with_retries(flaky([_Code(code)]), 2, lambda: True, on_retry)
    with pytest.raises(ValueError):  # retries used up
        sources.read_with_retries(flaky([ValueError("a")] * 3), 2, lambda: True, on_retry)
    with pytest.raises(ValueError):  # the reader no longer wants the rows
        sources.read_with_retries(flaky([ValueError("a")]), 2, lambda: False, on_retry)
    assert retried == [1, 2, 1, 2]
