"""The consumer's side of the data path: where a decode reads the rows a ReadReady announced.
Same host: straight out of the prefill's shared-memory layer buffer (``BufferRegion``); other
hosts: streamed from the prefill's ``LayerSource`` in bounded chunks (``pdlink.chunks``).
``RowSources`` keeps the attached segments and the channels until it is closed; ``read_with_retries``
is the retry policy of a read out of either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import structlog
import torch

from kvcore.pool.segment import SharedSegment
from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc

log = structlog.get_logger(__name__)
T = TypeVar("T")

PERMANENT = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.INVALID_ARGUMENT,
)  # a LayerSource answer that a retry cannot change


def read_with_retries(
    read: Callable[[], T], retries: int, still_wanted: Callable[[], bool], on_retry: Callable[[int, Exception], None]
) -> T:
    """``read()``, again after a failure that a retry can change (a dropped stream: ``grpc.RpcError``
    other than ``PERMANENT``; a short read: ``ValueError``) up to ``retries`` times while
    ``still_wanted()``, after ``on_retry(attempt, error)`` and a backoff of 50 ms x 2^attempt; the
    last failure propagates. Reads are idempotent: the same rows land in the same place."""
    for attempt in range(retries + 1):
        try:
            return read()
        except (grpc.RpcError, ValueError) as exc:
            code = exc.code() if isinstance(exc, grpc.RpcError) else None
            if code in PERMANENT or attempt == retries or not still_wanted():
                raise
            on_retry(attempt + 1, exc)
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


class RowSources:
    """Reads rows of one plane of a prefill's layer buffer, as uint8 ``[n, row_bytes]``: out of its
    shared-memory segment (attached on first use and kept while its owner lives: attaching a new
    one first lets go of every segment whose prefill is gone, e.g. restarted under a new segment
    name) or streamed from its LayerSource (a channel per endpoint, made by ``connect`` on first use
    and kept) until ``close``."""

    def __init__(self, connect: Callable[[str], grpc.Channel]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._segments: dict[str, SharedSegment] = {}
        self._channels: dict[str, grpc.Channel] = {}

    def shared_rows(self, region, start: int, end: int, row_bytes: int) -> torch.Tensor:
        """Rows [start, end) of a ``BufferRegion``: a view of the prefill's memory (installing them
        is the one copy READ_DONE waits for). ValueError if the region cannot hold them."""
        if end > region.capacity_tokens or region.row_stride_bytes != row_bytes:
            raise ValueError(
                f"buffer region of {region.capacity_tokens} rows x {region.row_stride_bytes} bytes "
                f"cannot give rows [{start}, {end}) of {row_bytes} bytes"
            )
        with self._lock:
            seg = self._segments.get(region.segment_name)
            if seg is None:
                for name in [n for n, old in self._segments.items() if old.gone()]:
                    self._segments.pop(name).close()
                    log.info("prefill_segment_released", segment=name)
                seg = self._segments[region.segment_name] = SharedSegment.attach(region.segment_name)
        plane = seg.plane_offsets.index(region.offset_bytes)
        rows = seg.plane(plane).view(-1, row_bytes)  # [capacity, row_bytes] uint8, the prefill's memory
        return rows[start:end]

    def streamed_rows(self, endpoint: str, request, kind, row_bytes: int) -> torch.Tensor:
        """The ReadReady's rows of one plane (``kind``) from the LayerSource at ``endpoint``;
        grpc.RpcError as the source answers, ValueError for chunks that do not add up."""
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = self._channels[endpoint] = self._connect(endpoint)
        stub = transfer_pb2_grpc.LayerSourceStub(channel)
        n = request.src_end - request.src_start
        out = torch.empty(n * row_bytes, dtype=torch.uint8)
        seen = 0
        for chunk in stub.ReadLayer(
            transfer_pb2.ReadLayerRequest(
                request_id=request.request_id,
                layer=request.layer,
                kind=kind,
                src_start=request.src_start,
                src_end=request.src_end,
                generation=request.generation,
                layout_version=request.layout_version,
            ),
            timeout=60,
        ):
            if chunk.total_bytes != out.numel() or chunk.offset_bytes + len(chunk.data) > out.numel():
                raise ValueError(
                    f"LayerSource chunk at {chunk.offset_bytes} (+{len(chunk.data)}) does not fit {out.numel()} bytes"
                )
            out[chunk.offset_bytes : chunk.offset_bytes + len(chunk.data)] = torch.frombuffer(
                bytearray(chunk.data), dtype=torch.uint8
            )
            seen += len(chunk.data)
        if seen != out.numel():
            raise ValueError(f"LayerSource sent {seen} of {out.numel()} bytes")
        return out.view(n, row_bytes)

    def close(self) -> None:
        with self._lock:
            for seg in self._segments.values():
                seg.close()
            for ch in self._channels.values():
                ch.close()
