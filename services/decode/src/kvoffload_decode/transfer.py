"""The decode's control port: layout exchange, per-layer pulls (READ_READY -> READ_DONE/FAILED),
and the end of a prefill. Thin: it converts proto messages to ``DecodeLoop`` calls.

Every ReadReady is answered (READ_DONE or READ_FAILED) so the prefill's reuse gate never waits
forever; a malformed or unknown message is rejected with a gRPC status and changes nothing.
Same host: rows are copied straight out of the prefill's shared-memory layer buffer; other hosts:
streamed from the prefill's LayerSource in bounded chunks. A failed read of the source is retried
(idempotently: the same rows land in the same place) up to ``read_retries`` times before the
answer is READ_FAILED. Heartbeats, ReadReady and PrefillDone are the news that keep a pending
request's watchdog (see ``DecodeLoop``) quiet.
"""

from __future__ import annotations

import threading
import time

import grpc
import structlog
import torch
from kvcore.layout import KVLayout, dtype_name
from kvcore.segment import SharedSegment
from kvcore.tls import PROCESS, secure_or_insecure_channel
from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc

from kvoffload_decode.loop import DecodeLoop

log = structlog.get_logger(__name__)

class TransferServicer(transfer_pb2_grpc.TransferServicer):
    """Serves ``kvoffload.v1.Transfer`` for one decode rank."""

    def __init__(self, loop: DecodeLoop, layout: KVLayout, model_id: str, host_id: str, dtype: torch.dtype,
                 read_retries: int = 2, tls=PROCESS) -> None:
        self.tls = tls  # for the streamed pulls from a prefill's LayerSource; the process's TLS by default
        self.loop, self.layout, self.model_id, self.host_id, self.dtype = loop, layout, model_id, host_id, dtype
        self.read_retries = read_retries
        self._layouts: dict[int, transfer_pb2.LayoutMetadata] = {}
        self._segments: dict[str, SharedSegment] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        # read_ms_total: time the pulls spent moving data (reading the source + installing the rows)
        self.counters = {"read_done": 0, "read_failed": 0, "read_retries": 0, "bytes_read": 0, "read_ms_total": 0.0,
                         "reads_shared_memory": 0, "reads_streamed": 0, "heartbeats": 0}

    # ---- layout --------------------------------------------------------------------------------

    def ExchangeLayout(self, request, context):
        reason = self._check_layout(request)
        if not reason:
            with self._lock:
                self._layouts[request.layout_version] = request
        log.info("layout_exchange", accepted=not reason, reason=reason, layout_version=request.layout_version,
                 data_endpoint=request.data_endpoint)
        return transfer_pb2.LayoutAck(accepted=not reason, reason=reason, layout_version=request.layout_version,
                                      decode_tp_rank=0, decode_tp_size=1,
                                      shared_memory=request.host_id == self.host_id)

    def _check_layout(self, m) -> str:
        if m.layout_version == 0:
            return "layout_version: must be > 0"
        if m.model_id != self.model_id:
            return f"model_id: prefill serves {m.model_id!r}, this decode {self.model_id!r}"
        if m.num_layers != self.layout.num_layers or len(m.layers) != m.num_layers:
            return f"num_layers: prefill has {m.num_layers} ({len(m.layers)} described), decode {self.layout.num_layers}"
        if m.block_size != self.layout.block_size:
            return f"block_size: prefill {m.block_size}, decode {self.layout.block_size}"
        if m.prefill_tp_size < 1 or m.prefill_tp_size % 1:
            return f"prefill_tp_size: {m.prefill_tp_size} is not a multiple of the decode TP size 1"
        for spec, got in zip(self.layout.layers, m.layers):
            want_idx = spec.indexer.row_bytes if spec.indexer else 0
            want_idx_dtype = dtype_name(spec.indexer.dtype) if spec.indexer else ""
            if got.layer != spec.index or got.main_row_bytes != spec.main.row_bytes \
                    or got.indexer_row_bytes != want_idx or got.main_dtype != dtype_name(spec.main.dtype) \
                    or got.indexer_dtype != want_idx_dtype:
                return (f"layers[{spec.index}]: prefill layer {got.layer} rows {got.main_row_bytes}/"
                        f"{got.indexer_row_bytes} bytes {got.main_dtype}/{got.indexer_dtype or '-'}, decode layer "
                        f"{spec.index} rows {spec.main.row_bytes}/{want_idx} bytes "
                        f"{dtype_name(spec.main.dtype)}/{want_idx_dtype or '-'}")
        return ""

    def _accepted_layout(self, layout_version: int, context):
        """The layout the prefill sent under ``layout_version``; FAILED_PRECONDITION without one."""
        with self._lock:
            meta = self._layouts.get(layout_version)
        if meta is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"no accepted layout with layout_version {layout_version}: call ExchangeLayout first")
        return meta

    # ---- pulls ---------------------------------------------------------------------------------

    def ReadReady(self, request, context):
        meta = self._accepted_layout(request.layout_version, context)
        if request.layer >= self.layout.num_layers or request.src_end < request.src_start:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"layer {request.layer} (0..{self.layout.num_layers - 1}) or range "
                          f"[{request.src_start}, {request.src_end}) is malformed")
        req = self.loop.pending_request(request.request_id)
        if req is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"request {request.request_id!r} is not waiting for KV here")
        n = request.src_end - request.src_start
        if request.dst_start + n > req.num_prompt_tokens:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"rows [{request.dst_start}, {request.dst_start + n}) go past the prompt's "
                          f"{req.num_prompt_tokens} tokens")
        self.loop.heard_from_prefill(request.request_id, f"prefill {meta.data_endpoint}")  # a well-formed report
        with self.loop.lock:
            installed = req.rows[request.layer]
        if n and request.dst_start + n <= installed:  # a retry or duplicate: the rows are here, the first
            return transfer_pb2.ReadResult(status=transfer_pb2.READ_DONE)  # result stands (no re-pull, no recount)
        try:
            t = time.perf_counter()
            kv, idx = self._read_with_retries(meta, request)
            copy_s = time.perf_counter() - t  # the pull's own data movement: read out of the
            copy_s += self.loop.write_rows(request.request_id, request.layer, request.dst_start, kv, idx)  # source, install
        except Exception as exc:  # answered, never left hanging: the prefill fails the slot's read
            self.counters["read_failed"] += 1
            reason = f"pull of layer {request.layer} rows [{request.src_start}, {request.src_end}) failed: {exc!r}"
            log.warning("read_failed", request_id=request.request_id, layer=request.layer, reason=reason)
            return transfer_pb2.ReadResult(status=transfer_pb2.READ_FAILED, reason=reason)
        ms = copy_s * 1000
        nbytes = kv.numel() * kv.element_size() + idx.numel() * idx.element_size()
        self.counters["read_done"] += 1
        self.counters["bytes_read"] += nbytes
        self.counters["read_ms_total"] += ms
        return transfer_pb2.ReadResult(status=transfer_pb2.READ_DONE, bytes_read=nbytes, read_ms=int(ms))

    def _read_with_retries(self, meta, request) -> tuple[torch.Tensor, torch.Tensor]:
        """``_read``, again after a failure (a dropped stream, a short read) up to ``read_retries``
        times while the request still waits; the last failure propagates."""
        for attempt in range(self.read_retries + 1):
            try:
                return self._read(meta, request)
            except (grpc.RpcError, ValueError) as exc:
                code = exc.code() if isinstance(exc, grpc.RpcError) else None
                permanent = code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                                     grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT)
                if permanent or attempt == self.read_retries or self.loop.pending_request(request.request_id) is None:
                    raise
                self.counters["read_retries"] += 1
                log.warning("read_retry", request_id=request.request_id, layer=request.layer, attempt=attempt + 1,
                            error=repr(exc))
                time.sleep(0.05 * 2**attempt)
        raise AssertionError("unreachable")

    def _read(self, meta, request) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [src_start, src_end) of one layer: (kv [n, W], index_k [n, Di]) in the model dtype."""
        spec = self.layout.layers[request.layer]
        lay = meta.layers[request.layer]
        parts = []
        for kind, region, cache in ((transfer_pb2.PLANE_KIND_MAIN, lay.main_buffer, spec.main),
                                    (transfer_pb2.PLANE_KIND_INDEXER, lay.indexer_buffer, spec.indexer)):
            if meta.host_id == self.host_id and region.segment_name:
                raw = self._shared_rows(region, request.src_start, request.src_end, cache.row_bytes)
                self.counters["reads_shared_memory"] += 1
            else:
                raw = self._streamed_rows(meta.data_endpoint, request, kind, cache.row_bytes)
                self.counters["reads_streamed"] += 1
            parts.append(raw.view(cache.dtype).view(-1, cache.width))
        return parts[0], parts[1]

    def _shared_rows(self, region, start: int, end: int, row_bytes: int) -> torch.Tensor:
        if end > region.capacity_tokens or region.row_stride_bytes != row_bytes:
            raise ValueError(f"buffer region of {region.capacity_tokens} rows x {region.row_stride_bytes} bytes "
                             f"cannot give rows [{start}, {end}) of {row_bytes} bytes")
        with self._lock:
            seg = self._segments.get(region.segment_name)
            if seg is None:
                seg = self._segments[region.segment_name] = SharedSegment.attach(region.segment_name)
        plane = seg.plane_offsets.index(region.offset_bytes)
        rows = seg.plane(plane).view(-1, row_bytes)  # [capacity, row_bytes] uint8, the prefill's memory
        return rows[start:end]  # a view: installing the rows is the one copy READ_DONE waits for

    def _streamed_rows(self, endpoint: str, request, kind, row_bytes: int) -> torch.Tensor:
        with self._lock:
            channel = self._channels.get(endpoint)
            if channel is None:
                channel = self._channels[endpoint] = secure_or_insecure_channel(endpoint, self.tls)
        stub = transfer_pb2_grpc.LayerSourceStub(channel)
        n = request.src_end - request.src_start
        out = torch.empty(n * row_bytes, dtype=torch.uint8)
        seen = 0
        for chunk in stub.ReadLayer(transfer_pb2.ReadLayerRequest(
                request_id=request.request_id, layer=request.layer, kind=kind, src_start=request.src_start,
                src_end=request.src_end, generation=request.generation, layout_version=request.layout_version),
                timeout=60):
            if chunk.total_bytes != out.numel() or chunk.offset_bytes + len(chunk.data) > out.numel():
                raise ValueError(f"LayerSource chunk at {chunk.offset_bytes} (+{len(chunk.data)}) does not fit "
                                 f"{out.numel()} bytes")
            out[chunk.offset_bytes : chunk.offset_bytes + len(chunk.data)] = torch.frombuffer(
                bytearray(chunk.data), dtype=torch.uint8)
            seen += len(chunk.data)
        if seen != out.numel():
            raise ValueError(f"LayerSource sent {seen} of {out.numel()} bytes")
        return out.view(n, row_bytes)

    # ---- end of a prefill ----------------------------------------------------------------------

    def Heartbeat(self, request, context):
        meta = self._accepted_layout(request.layout_version, context)
        peer = f"prefill {meta.data_endpoint}"
        unknown = [rid for rid in request.request_ids if not self.loop.heard_from_prefill(rid, peer)]
        self.counters["heartbeats"] += 1
        return transfer_pb2.PrefillHeartbeatReply(unknown_request_ids=unknown)

    def PrefillDone(self, request, context):
        meta = self._accepted_layout(request.layout_version, context)
        reason = self._premature(request)
        if not reason:
            self.loop.heard_from_prefill(request.request_id, f"prefill {meta.data_endpoint}")
        try:
            reason = reason or self.loop.prefill_done(request.request_id, request.num_prompt_tokens,
                                                      request.first_token)
        except KeyError:
            context.abort(grpc.StatusCode.NOT_FOUND, f"request {request.request_id!r} is not waiting for KV here")
        return transfer_pb2.PrefillDoneReply(accepted=not reason, reason=reason)

    def _premature(self, request) -> str:
        """Why a PrefillDone cannot be taken yet ("" if it can): the prefill sends it only after every
        layer's READ_DONE, so a missing layer means it came early; a first token is never replaced."""
        with self.loop.lock:
            req = self.loop.pending.get(request.request_id)
            if req is None or request.num_prompt_tokens != req.num_prompt_tokens:
                return ""  # prefill_done names these
            missing = next(((i, r) for i, r in enumerate(req.rows) if r < req.num_prompt_tokens), None)
            if missing is not None:
                return (f"layer {missing[0]} has {missing[1]} of {req.num_prompt_tokens} rows: PrefillDone must "
                        "follow every layer's READ_DONE")
            if req.first_token is not None and req.first_token != request.first_token:
                return f"the first token is already {req.first_token} (this PrefillDone says {request.first_token})"
            return ""

    def close(self) -> None:
        with self._lock:
            for seg in self._segments.values():
                seg.close()
            for ch in self._channels.values():
                ch.close()
            self._segments.clear()
            self._channels.clear()
