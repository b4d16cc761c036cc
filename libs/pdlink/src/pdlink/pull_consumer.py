"""The consumer's side of the P->D transfer contract (``kvoffload.v1.Transfer``), one state machine
for every consumer: which prefill layouts are accepted, what a ReadReady asks for, pulling the
announced rows (with retries) and handing them to a ``RowSink``, heartbeats, the end of a
prefill, and the counters of it all. ``pdlink.transfer_service`` serves it over gRPC.

A ``RowSink`` is where pulled rows go and what the consumer knows of its requests: the decode
service's host pool (``kvoffload_decode.pull``), a vLLM decode's paged blocks
(``kvoffload_vllm.d2h_consumer``). The hooks, in the order a ReadReady calls them:

- ``begin(read)``: the request is waiting here (else ``UnknownRequest``) and the range fits it
  (else ``MalformedRead``); the prefill was heard from. Returns the source rows to pull (a
  ``range``, which may widen the announced one, e.g. to whole blocks) or, when nothing needs
  pulling, the answer at once (a ``ReadOutcome``: done for rows already installed).
- ``wanted(request_id)``: whether a failed read is worth retrying (the request still waits).
- ``install(read, rows, planes)``: write the pulled rows, one uint8 ``[n, row_bytes]`` tensor per
  plane of ``planes(layer)``, ``row_bytes`` as the prefill's layout gives them (the sink's own, unless
  its ``layout_problem`` accepted rows that are a part of its own: a TP head slice); returns the
  seconds it took; raising fails the read.
- ``failed(read, reason)``: the read was answered READ_FAILED (after ``begin``).
- ``end(read)``: the read is over, answered either way (after a ``begin`` that returned a range).

A sink that reads through a transfer engine of its own straight into its memory (a vLLM decode's
blocks: ``kvoffload_vllm.d2h_consumer``) names that engine in ``transfer_engine`` and reads and installs
in one hook instead of ``install``: ``read_in_place(read, rows)``, returning the bytes and seconds.

and for the other messages ``layout_problem(meta)`` (what this sink needs of a layout beyond the
common checks), ``heard(request_id, endpoint)`` (a heartbeat: still waiting?) and
``prefill_done(request, endpoint)``.

A malformed or unknown message raises a ``pdlink.refusals.Refused`` and changes nothing; every
well-formed ReadReady gets an answer (``ReadOutcome``), so the prefill's reuse gate never waits
forever. Same host: planes are read straight out of the prefill's shared-memory layer buffers;
other hosts: streamed from its LayerSource in bounded chunks (``pdlink.sources.RowSources``). With
transfer_backend "memfabric" or "mooncake" every layer is read through that transfer engine
instead (``pdlink.engine_rows``: both planes in one batched read) and a layout of another transfer
backend is refused. A failed read of the source is retried (idempotently: the same rows land in
the same place) up to ``read_retries`` times while the request still waits; a failed engine read
is failed at once. Everything here may be called
from many gRPC threads at once.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import structlog
import torch

from kvcore.pdpair import tp_handshake_problem
from kvcore.transferregistry import EMBEDDED
from kvoffload_proto.v1 import transfer_pb2
from pdlink.engine_rows import EngineRows
from pdlink.pullcounters import PullCounters
from pdlink.refusals import MalformedRead, NoAcceptedLayout
from pdlink.sources import RowSources, read_with_retries

log = structlog.get_logger(__name__)

__all__ = ["Plane", "PullConsumer", "Read", "ReadOutcome", "RowSink"]


@dataclass(frozen=True)
class Plane:
    """One plane a sink takes of every layer: its kind (``PLANE_KIND_MAIN`` / ``_INDEXER``) and the
    bytes of one of its rows."""

    kind: int
    row_bytes: int


@dataclass(frozen=True)
class Read:
    """One well-formed ReadReady and the accepted layout it names."""

    request: transfer_pb2.ReadReadyRequest
    meta: transfer_pb2.LayoutMetadata

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def layer(self) -> int:
        return self.request.layer

    @property
    def endpoint(self) -> str:
        """The prefill's data endpoint (its name in logs and reasons)."""
        return self.meta.data_endpoint


@dataclass(frozen=True)
class ReadOutcome:
    """The answer to a well-formed ReadReady: done (``bytes_read``/``read_ms`` of the pull; 0 when
    nothing needed pulling) or failed, with the ``reason``."""

    done: bool
    reason: str = ""
    bytes_read: int = 0
    read_ms: float = 0.0


class RowSink(ABC):
    """Where a consumer's pulled rows go (module doc, hook by hook). ``num_layers`` and
    ``block_size`` (each layer's: ``layer_block_size``) are what a prefill's layout must match."""

    num_layers: int
    block_size: int
    transfer_engine = ""  # the engine ``read_in_place`` reads through; "": the consumer reads, ``install`` writes

    def layer_block_size(self, layer: int) -> int:
        """Tokens per block of ``layer`` (``block_size`` unless the sink's layers differ: vLLM's hybrid
        KV cache manager gives each KV cache group its own)."""
        return self.block_size

    @abstractmethod
    def layout_problem(self, meta: transfer_pb2.LayoutMetadata) -> str:
        """ "" if this sink takes rows of layout ``meta`` (after the common checks), else the first mismatch."""

    @abstractmethod
    def planes(self, layer: int) -> list[Plane]:
        """What to read of ``layer``, in the order ``install`` takes them."""

    @abstractmethod
    def begin(self, read: Read) -> range | ReadOutcome:
        """The rows to pull for ``read``, or the answer at once (module doc)."""

    @abstractmethod
    def wanted(self, request_id: str) -> bool:
        """Whether the request still waits (a failed read is retried only then)."""

    @abstractmethod
    def install(self, read: Read, rows: range, planes: list[torch.Tensor]) -> float:
        """Write the pulled rows (one uint8 ``[n, row_bytes]`` per plane); the seconds it took."""

    def read_in_place(self, read: Read, rows: range) -> tuple[int, float]:
        """A sink with a ``transfer_engine``: read source rows ``rows`` through it straight into this
        sink's memory; (bytes read, seconds). Raising fails the read."""
        raise NotImplementedError(f"{type(self).__name__} reads through no transfer engine of its own")

    def failed(self, read: Read, reason: str) -> None:  # noqa: B027 - an optional hook, doing nothing by default
        """Nothing by default: the prefill, told READ_FAILED, ends the request."""

    def end(self, read: Read) -> None:  # noqa: B027 - an optional hook, doing nothing by default
        """Nothing by default."""

    @abstractmethod
    def heard(self, request_id: str, endpoint: str) -> bool:
        """A heartbeat from the prefill at ``endpoint``: whether the request still waits here."""

    @abstractmethod
    def prefill_done(self, request: transfer_pb2.PrefillDoneRequest, endpoint: str) -> str:
        """ "" when the prefill's end of ``request`` is taken, else why not; ``UnknownRequest`` if it
        is not waiting here."""


class PullConsumer:
    """One consumer rank's side of the transfer (module doc): the layouts it accepted (by
    ``layout_version``), the pulls into ``sink`` (through ``sources``, or the transfer engine's ``engine`` when given),
    heartbeats and PrefillDone, and the ``counters``. ``host_id`` None: never the prefill's host."""

    def __init__(
        self,
        sink: RowSink,
        sources: RowSources,
        *,
        model_id: str,
        host_id: str | None = None,
        read_retries: int = 2,
        engine: EngineRows | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.sink, self.sources, self.engine = sink, sources, engine
        self.model_id, self.host_id, self.read_retries = model_id, host_id, read_retries
        self.tp_rank, self.tp_size = tp_rank, tp_size  # this consumer rank: only its contributors' layouts
        self.counters = PullCounters()
        self._layouts: dict[int, transfer_pb2.LayoutMetadata] = {}
        self._lock = threading.Lock()

    # ---- layout --------------------------------------------------------------------------------

    def exchange_layout(self, m: transfer_pb2.LayoutMetadata) -> str:
        """Accept the prefill's layout (kept under its ``layout_version``, replacing an earlier one)
        and return ""; or return why not, keeping what was accepted before."""
        reason = self.check_layout(m)
        if not reason:
            with self._lock:
                self._layouts[m.layout_version] = m
        log.info(
            "layout_exchange",
            accepted=not reason,
            reason=reason,
            layout_version=m.layout_version,
            data_endpoint=m.data_endpoint,
            prefill_tp_rank=m.prefill_tp_rank,
            prefill_tp_size=m.prefill_tp_size,
            decode_tp_rank=self.tp_rank,
            decode_tp_size=self.tp_size,
        )
        return reason

    def check_layout(self, m: transfer_pb2.LayoutMetadata) -> str:
        """ "" if this consumer can pull from a prefill with layout ``m``, else the first mismatch."""
        sink = self.sink
        if m.layout_version == 0:
            return "layout_version: must be > 0"
        if m.model_id != self.model_id:
            return f"model_id: prefill {m.model_id!r}, decode {self.model_id!r}"
        if m.num_layers != sink.num_layers or len(m.layers) != m.num_layers:
            return f"num_layers: prefill {m.num_layers} ({len(m.layers)} described), decode {sink.num_layers}"
        if m.block_size != sink.block_size:
            return f"block_size: prefill {m.block_size}, decode {sink.block_size}"
        for i, lay in enumerate(m.layers):  # a layer's own block size; 0: the layout's
            if (lay.block_size or m.block_size) != sink.layer_block_size(i):
                return (
                    f"layers[{i}].block_size: prefill {lay.block_size or m.block_size}, "
                    f"decode {sink.layer_block_size(i)}"
                )
        mine = self.engine.name if self.engine is not None else (sink.transfer_engine or EMBEDDED)
        theirs = m.transfer_engine or EMBEDDED
        if mine != theirs:
            return (
                f"transfer_engine: the prefill's transfer_backend is {theirs!r} (session "
                f"{m.engine_session or 'none'}), this decode's {mine!r}; both sides must use the same one"
            )
        return tp_handshake_problem(
            m.prefill_tp_size, m.prefill_tp_rank, self.tp_size, self.tp_rank
        ) or sink.layout_problem(m)

    def same_host(self, host_id: str) -> bool:
        """Whether a prefill on ``host_id`` shares this consumer's shared memory."""
        return self.host_id is not None and host_id == self.host_id

    def accepted_layout(self, layout_version: int) -> transfer_pb2.LayoutMetadata:
        """The layout the prefill sent under ``layout_version``; NoAcceptedLayout without one."""
        with self._lock:
            meta = self._layouts.get(layout_version)
        if meta is None:
            raise NoAcceptedLayout(
                f"no accepted layout with layout_version {layout_version}: call ExchangeLayout first"
            )
        return meta

    def layouts(self) -> dict[int, transfer_pb2.LayoutMetadata]:
        """A copy of the accepted layouts by ``layout_version``."""
        with self._lock:
            return dict(self._layouts)

    # ---- pulls ---------------------------------------------------------------------------------

    def read_ready(self, request: transfer_pb2.ReadReadyRequest) -> ReadOutcome:
        """Pull the announced rows into the sink. Refused (nothing changed, nothing pulled) for a
        malformed or unknown ReadReady; else the answer. Rows the sink already holds (a retry or a
        duplicate) are not pulled again: the first result stands, counted once."""
        meta = self.accepted_layout(request.layout_version)
        if request.layer >= self.sink.num_layers or request.src_end < request.src_start:
            raise MalformedRead(
                f"layer {request.layer} (0..{self.sink.num_layers - 1}) or range "
                f"[{request.src_start}, {request.src_end}) is malformed"
            )
        read = Read(request, meta)
        rows = self.sink.begin(read)
        if isinstance(rows, ReadOutcome):
            return rows
        try:
            return self._pull(read, rows)
        finally:
            self.sink.end(read)

    def _pull(self, read: Read, rows: range) -> ReadOutcome:
        try:
            if self.sink.transfer_engine:  # read and installed in one, through the sink's engine
                self.counters.increment("reads_engine")
                nbytes, copy_s = self.sink.read_in_place(read, rows)
            else:
                t = time.perf_counter()
                planes = self._read_with_retries(read, rows)
                copy_s = time.perf_counter() - t  # the pull's own data movement: read out of the source,
                copy_s += self.sink.install(read, rows, planes)  # then install
                nbytes = sum(p.numel() * p.element_size() for p in planes)
        except Exception as exc:  # noqa: BLE001 - answered, never left hanging: the prefill fails the slot's read
            self.counters.increment("read_failed")
            reason = (
                f"pull of layer {read.layer} rows [{read.request.src_start}, {read.request.src_end}) "
                f"from {read.endpoint} failed: {exc!r}"
            )
            log.warning("read_failed", request_id=read.request_id, layer=read.layer, reason=reason)
            self.sink.failed(read, reason)
            return ReadOutcome(done=False, reason=reason)
        ms = copy_s * 1000
        self.counters.add_read(read.meta.prefill_tp_rank, nbytes, ms)
        return ReadOutcome(done=True, bytes_read=nbytes, read_ms=ms)

    def _read_with_retries(self, read: Read, rows: range) -> list[torch.Tensor]:
        """``_read``, again after a failure (a dropped stream, a short read) up to ``read_retries``
        times while the request still waits (``pdlink.sources.read_with_retries``)."""

        def on_retry(attempt: int, exc: Exception) -> None:
            self.counters.increment("read_retries")
            log.warning("read_retry", request_id=read.request_id, layer=read.layer, attempt=attempt, error=repr(exc))

        return read_with_retries(
            lambda: self._read(read, rows), self.read_retries, lambda: self.sink.wanted(read.request_id), on_retry
        )

    def _read(self, read: Read, rows: range) -> list[torch.Tensor]:
        """Source rows ``rows`` of each of the sink's planes of the layer: uint8 ``[n, row_bytes]``."""
        lay = read.meta.layers[read.layer]
        planes = [  # rows as the prefill holds them: a TP head slice may be a part of the sink's row
            Plane(p.kind, lay.main_row_bytes if p.kind == transfer_pb2.PLANE_KIND_MAIN else lay.indexer_row_bytes)
            for p in self.sink.planes(read.layer)
        ]
        regions = [lay.main_buffer if p.kind == transfer_pb2.PLANE_KIND_MAIN else lay.indexer_buffer for p in planes]
        if self.engine is not None:  # every plane in one batched read of the transfer engine
            self.counters.increment("reads_engine")
            return self.engine.layer_rows(
                read.meta,
                rows.start,
                rows.stop,
                [(region, p.row_bytes) for region, p in zip(regions, planes, strict=True)],
            )
        ask = transfer_pb2.ReadReadyRequest(
            request_id=read.request_id,
            layer=read.layer,
            generation=read.request.generation,
            src_start=rows.start,
            src_end=rows.stop,
            layout_version=read.request.layout_version,
        )
        out = []
        for plane, region in zip(planes, regions, strict=True):
            if self.same_host(read.meta.host_id) and region.segment_name:
                out.append(self.sources.shared_rows(region, rows.start, rows.stop, plane.row_bytes))
                self.counters.increment("reads_shared_memory")
            else:
                out.append(self.sources.streamed_rows(read.endpoint, ask, plane.kind, plane.row_bytes))
                self.counters.increment("reads_streamed")
        return out

    # ---- the prefill's other news --------------------------------------------------------------

    def heartbeat(self, layout_version: int, request_ids: Iterable[str]) -> list[str]:
        """The prefill is alive and still working on ``request_ids``; returns those not waiting here."""
        meta = self.accepted_layout(layout_version)
        unknown = [rid for rid in request_ids if not self.sink.heard(rid, meta.data_endpoint)]
        self.counters.increment("heartbeats")
        return unknown

    def prefill_done(self, request: transfer_pb2.PrefillDoneRequest) -> str:
        """The prefill finished a request: "" when the sink takes it, else why not."""
        meta = self.accepted_layout(request.layout_version)
        return self.sink.prefill_done(request, meta.data_endpoint)

    def close(self) -> None:
        self.sources.close()
        if self.engine is not None:
            self.engine.close()
