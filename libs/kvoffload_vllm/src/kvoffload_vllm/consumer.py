"""The remote D2H consumer inside a vLLM decode worker: register, pull each layer, report.

Per new request (``begin_step``): a thread POSTs this worker's control endpoint to the proxy's
``/v1/metaserver`` (the proxy answers once the prefill answered). The Transfer gRPC server on the
control port takes the prefill's layout (checked against this engine's: model and vLLM layout
digest, layers, block size, row bytes, dtype; a mismatch is refused naming both sides), its
ReadReady announcements and heartbeats. A ReadReady pulls whole blocks from the prefill's
LayerSource (``pdlink.sources.RowSources``) and writes those that improve on what landed
(``kvoffload_vllm.d2h_plan.Coverage``) into the request's vLLM blocks, then answers READ_DONE.

A request ends in exactly one of three ways, each reported once by ``finished`` after no pull is
writing its blocks any more: every layer landed (a finished receive); a pull failed, the
registration failed, or the prefill went silent for longer than ``peer_timeout_s`` once the
prefill had started (a failed receive: vLLM recomputes or fails it, I5); vLLM finished it while
it was loading (a client gone: a finished receive, so vLLM frees the blocks).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import structlog
import torch
from kvcore.layout import dtype_name
from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc
from pdlink.sources import RowSources, read_with_retries
from svcruntime.tls import PROCESS, add_port, secure_or_insecure_channel

from kvoffload_vllm.d2h_plan import Coverage, blocks_of
from kvoffload_vllm.layout import CacheLayout
from kvoffload_vllm.refused import Refused
from kvoffload_vllm.stats import Counters

log = structlog.get_logger("vllm.kvoffload.consumer")

COUNTERS = {
    "requests_pulled": "decode requests whose prompt KV landed completely",
    "requests_failed": "decode requests whose pull failed (vLLM recomputes or fails them)",
    "requests_cancelled": "decode requests vLLM finished while their KV was loading",
    "reads_done": "ReadReady announcements answered READ_DONE",
    "reads_failed": "ReadReady announcements answered READ_FAILED",
    "blocks_pulled": "blocks (of one layer) written into vLLM's cache",
    "bytes_pulled": "bytes streamed from prefills",
    "pull_ms": "milliseconds spent pulling and writing blocks",
    "heartbeats": "prefill heartbeats taken",
}
REGISTRATION_TIMEOUT_S = 1800.0  # a backstop: the proxy answers within its own request deadline
REGISTRATION_RETRIES = 3
READ_RETRIES = 2
WATCHDOG_S = 0.25


@dataclass
class _Incoming:
    recv: object  # d2h.Recv
    coverage: Coverage
    block_ids: torch.Tensor
    started: float = field(default_factory=time.monotonic)
    last_news: float = 0.0  # monotonic time of the prefill's last word; 0 before it started
    peer: str = ""
    state: str = "loading"  # loading | done | failed | cancelled
    reason: str = ""
    busy: int = 0  # pulls in flight
    bytes: int = 0
    write_lock: threading.Lock = field(default_factory=threading.Lock)


class Consumer:
    def __init__(self, settings, model_id: str, layout: CacheLayout, caches: dict[str, torch.Tensor]) -> None:
        self.settings, self.model_id, self.layout = settings, model_id, layout
        self._bytes = [caches[name].view(torch.uint8).view(layout.num_blocks, layout.block_bytes)
                       for name in layout.layer_names]
        self._lock = threading.Lock()
        self._reqs: dict[str, _Incoming] = {}  # by transfer id
        self._by_req: dict[str, str] = {}  # vLLM request id -> transfer id
        self._layouts: dict[int, transfer_pb2.LayoutMetadata] = {}
        self.counters = Counters(COUNTERS)
        self._sources = RowSources(lambda endpoint: secure_or_insecure_channel(endpoint, PROCESS))
        self._stop = threading.Event()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvoffload-transfer"))
        transfer_pb2_grpc.add_TransferServicer_to_server(_Transfer(self), self._server)
        self.endpoint = f"{settings.advertise_host}:{settings.control_port}"
        if not add_port(self._server, self.endpoint):
            raise RuntimeError(f"cannot bind the decode control port {self.endpoint} (kv_port)")
        self._server.start()
        self._watchdog = threading.Thread(target=self._watch, name="kvoffload-watchdog", daemon=True)
        self._watchdog.start()
        log.info("kvoffload_d2h_consumer", control_endpoint=self.endpoint, layers=len(layout.layer_names),
                 block_bytes=layout.block_bytes, peer_timeout_s=settings.peer_timeout_s)

    # ---- the scheduler's news ----------------------------------------------------------------

    def begin_step(self, meta) -> None:
        for recv in meta.recvs:
            inc = _Incoming(recv, Coverage(len(self.layout.layer_names), recv.num_tokens, self.layout.block_size,
                                           recv.first_block), torch.tensor(recv.block_ids, dtype=torch.long))
            with self._lock:
                self._reqs[recv.transfer_id] = inc
                self._by_req[recv.req_id] = recv.transfer_id
            threading.Thread(target=self._register, args=(inc,), name="kvoffload-register", daemon=True).start()
        for rid in meta.cancelled:
            with self._lock:
                tid = self._by_req.get(rid)
                inc = self._reqs.get(tid) if tid else None
                if inc is not None and inc.state == "loading":
                    inc.state, inc.reason = "cancelled", "vLLM finished the request while its KV was loading"

    def _register(self, inc: _Incoming) -> None:
        """POST our endpoint to the proxy's metaserver; its answer comes once the prefill answered."""
        recv = inc.recv
        params = {"request_id": recv.transfer_id, "remote_host": self.settings.advertise_host,
                  "remote_port": self.settings.control_port, "remote_tp_size": 1,
                  "remote_dp_rank": self.settings.dp_rank}
        body = json.dumps({"request_id": recv.transfer_id, "kv_transfer_params": params}).encode()
        headers = {"Content-Type": "application/json", "X-Request-Id": recv.transfer_id}
        if recv.token:
            headers["Authorization"] = f"Bearer {recv.token}"
        problem = ""
        for attempt in range(REGISTRATION_RETRIES + 1):
            try:
                req = urllib.request.Request(recv.metaserver, data=body, headers=headers, method="POST")
                with urllib.request.urlopen(req, timeout=REGISTRATION_TIMEOUT_S) as resp:
                    resp.read()
                problem = ""
                break
            except urllib.error.HTTPError as exc:
                problem = f"metaserver {recv.metaserver} answered {exc.code}: {exc.read()[:300]!r}"
                break
            except (urllib.error.URLError, OSError) as exc:
                problem = f"metaserver {recv.metaserver} unreachable after {attempt + 1} attempts: {exc}"
                if self._stop.wait(0.2 * 2**attempt):
                    break
        if problem:
            self._fail(recv.transfer_id, problem)
            return
        with self._lock:
            if inc.state == "loading" and not inc.last_news:
                inc.last_news = time.monotonic()  # the prefill answered: its reads are due now
        log.info("kvoffload_d2h_registered", request_id=recv.req_id, transfer_id=recv.transfer_id,
                 seconds=round(time.monotonic() - inc.started, 3))

    def _fail(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            inc = self._reqs.get(transfer_id)
            if inc is None or inc.state != "loading":
                return
            inc.state, inc.reason = "failed", reason
        log.warning("kvoffload_d2h_load_failed", request_id=inc.recv.req_id, transfer_id=transfer_id, reason=reason,
                    layers_done=inc.coverage.layers_done())

    def _watch(self) -> None:
        while not self._stop.wait(WATCHDOG_S):
            now = time.monotonic()
            with self._lock:
                silent = [(tid, inc.peer, now - inc.last_news) for tid, inc in self._reqs.items()
                          if inc.state == "loading" and inc.last_news and now - inc.last_news > self.settings.peer_timeout_s]
            for tid, peer, quiet in silent:
                self._fail(tid, f"prefill {peer or '(none announced)'} silent for {quiet:.1f} s "
                                f"(peer_timeout_s {self.settings.peer_timeout_s:g})")

    def finished(self) -> tuple[set[str], set[str]]:
        """(vLLM ids whose KV landed or that were cancelled, ids whose load failed), each once."""
        done: set[str] = set()
        failed: set[str] = set()
        ended: list[_Incoming] = []
        with self._lock:
            for tid, inc in list(self._reqs.items()):
                if inc.state == "loading" or inc.busy:
                    continue
                self._reqs.pop(tid)
                self._by_req.pop(inc.recv.req_id, None)
                (failed if inc.state == "failed" else done).add(inc.recv.req_id)
                ended.append(inc)
        for inc in ended:
            seconds = round(time.monotonic() - inc.started, 3)
            if inc.state == "done":
                self.counters.add(requests_pulled=1)
                log.info("kvoffload_d2h_pulled", request_id=inc.recv.req_id, transfer_id=inc.recv.transfer_id,
                         tokens=inc.recv.num_tokens, bytes=inc.bytes, seconds=seconds, prefill=inc.peer)
            elif inc.state == "failed":
                self.counters.add(requests_failed=1)
            else:
                self.counters.add(requests_cancelled=1)
                log.info("kvoffload_d2h_cancelled", request_id=inc.recv.req_id, transfer_id=inc.recv.transfer_id)
        return done, failed

    # ---- the prefill's calls -----------------------------------------------------------------

    def exchange_layout(self, m: transfer_pb2.LayoutMetadata) -> str:
        reason = self._check_layout(m)
        if not reason:
            with self._lock:
                self._layouts[m.layout_version] = m
        log.info("kvoffload_d2h_layout", accepted=not reason, reason=reason, data_endpoint=m.data_endpoint,
                 layout_version=m.layout_version)
        return reason

    def _check_layout(self, m: transfer_pb2.LayoutMetadata) -> str:
        lay = self.layout
        row_bytes, dtype = lay.block_bytes // lay.block_size, dtype_name(lay.dtype)
        if m.layout_version == 0:
            return "layout_version: must be > 0"
        if m.model_id != self.model_id:
            return f"model_id: prefill {m.model_id!r}, decode {self.model_id!r} (model, vLLM version and KV layout)"
        if m.num_layers != len(lay.layer_names) or len(m.layers) != m.num_layers:
            return f"num_layers: prefill {m.num_layers} ({len(m.layers)} described), decode {len(lay.layer_names)}"
        if m.block_size != lay.block_size:
            return f"block_size: prefill {m.block_size}, decode {lay.block_size}"
        if m.prefill_tp_size != 1:
            return f"prefill_tp_size: prefill {m.prefill_tp_size}, decode 1 (one rank only for now)"
        for i, got in enumerate(m.layers):
            if got.layer != i or got.main_row_bytes != row_bytes or got.main_dtype != dtype or got.indexer_row_bytes:
                return (f"layers[{i}]: prefill layer {got.layer} rows {got.main_row_bytes} bytes {got.main_dtype} "
                        f"(indexer {got.indexer_row_bytes}), decode layer {i} rows {row_bytes} bytes {dtype} (no indexer)")
        return ""

    def heartbeat(self, layout_version: int, request_ids) -> list[str]:
        if layout_version not in self._layouts:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"no accepted layout {layout_version}")
        unknown = []
        now = time.monotonic()
        with self._lock:
            for rid in request_ids:
                inc = self._reqs.get(rid)
                if inc is None or inc.state != "loading":
                    unknown.append(rid)
                else:
                    inc.last_news = now
        self.counters.add(heartbeats=1)
        return unknown

    def read_ready(self, r: transfer_pb2.ReadReadyRequest) -> tuple[bool, str, int, float]:
        """Pull and write one announced range: (done, reason, bytes, ms); Refused when malformed."""
        meta = self._layouts.get(r.layout_version)
        if meta is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"no accepted layout with layout_version "
                          f"{r.layout_version}: call ExchangeLayout first")
        if r.layer >= len(self.layout.layer_names) or r.src_end < r.src_start or r.dst_start != r.src_start:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"layer {r.layer} or range [{r.src_start}, {r.src_end}) "
                          f"-> {r.dst_start} is malformed")
        with self._lock:
            inc = self._reqs.get(r.request_id)
            if inc is None:
                raise Refused(grpc.StatusCode.NOT_FOUND, f"request {r.request_id!r} is not waiting for KV here")
            if r.src_end > inc.recv.num_tokens:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"rows up to {r.src_end} go past the prompt's "
                              f"{inc.recv.num_tokens} tokens")
            if inc.state == "done":  # a late copy of tokens that all landed already
                return True, "", 0, 0.0
            if inc.state != "loading":
                return False, inc.reason or f"request {r.request_id!r} is {inc.state}", 0, 0.0
            inc.last_news, inc.peer = time.monotonic(), meta.data_endpoint
            inc.busy += 1
        try:
            with inc.write_lock:
                if not len(inc.coverage.to_write(r.layer, r.src_start, r.src_end)):
                    return True, "", 0, 0.0  # a retry or a duplicate: these tokens are here
            t = time.perf_counter()
            blocks = blocks_of(r.src_start, r.src_end, self.layout.block_size)
            data = self._pull(meta, r, blocks)
            # vLLM's caches, and what begin_step made under vLLM's inference mode, are inference tensors
            with inc.write_lock, torch.inference_mode():
                if inc.state != "loading":
                    return False, inc.reason, 0, 0.0
                idx = inc.coverage.to_write(r.layer, r.src_start, r.src_end)
                self._bytes[r.layer].index_copy_(0, inc.block_ids[blocks.start + idx], data[idx])
                inc.coverage.landed(r.layer, r.src_start, r.src_end, idx)
                complete = inc.coverage.complete
            ms = (time.perf_counter() - t) * 1000
            nbytes = int(data.numel())
            self.counters.add(reads_done=1, blocks_pulled=len(idx), bytes_pulled=nbytes, pull_ms=ms)
            with self._lock:
                inc.bytes += nbytes
                if complete and inc.state == "loading":
                    inc.state = "done"
            return True, "", nbytes, ms
        except Exception as exc:  # noqa: BLE001 - answered READ_FAILED and the request fails (I5)
            reason = f"pull of layer {r.layer} tokens [{r.src_start}, {r.src_end}) from {meta.data_endpoint} failed: {exc!r}"
            self.counters.add(reads_failed=1)
            self._fail(r.request_id, reason)
            return False, reason, 0, 0.0
        finally:
            with self._lock:
                inc.busy -= 1

    def _pull(self, meta, r, blocks: range) -> torch.Tensor:
        """The blocks ``blocks`` of one layer from the prefill: uint8 ``[n, block_bytes]``."""
        bs = self.layout.block_size
        ask = transfer_pb2.ReadReadyRequest(request_id=r.request_id, layer=r.layer, generation=r.generation,
                                            src_start=blocks.start * bs, src_end=blocks.stop * bs,
                                            layout_version=r.layout_version)

        def read() -> torch.Tensor:
            rows = self._sources.streamed_rows(meta.data_endpoint, ask, transfer_pb2.PLANE_KIND_MAIN,
                                               self.layout.block_bytes // bs)
            return rows.view(len(blocks), self.layout.block_bytes)

        def on_retry(attempt: int, exc: Exception) -> None:
            log.warning("kvoffload_d2h_read_retry", transfer_id=r.request_id, layer=r.layer, attempt=attempt,
                        error=repr(exc))

        return read_with_retries(read, READ_RETRIES, lambda: self._loading(r.request_id), on_retry)

    def _loading(self, transfer_id: str) -> bool:
        with self._lock:
            inc = self._reqs.get(transfer_id)
            return inc is not None and inc.state == "loading"

    def close(self) -> None:
        self._stop.set()
        self._server.stop(grace=1.0)
        self._sources.close()


class _Transfer(transfer_pb2_grpc.TransferServicer):
    """``kvoffload.v1.Transfer`` over a ``Consumer``."""

    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def ExchangeLayout(self, request, context):
        reason = self.consumer.exchange_layout(request)
        return transfer_pb2.LayoutAck(accepted=not reason, reason=reason, layout_version=request.layout_version,
                                      decode_tp_rank=0, decode_tp_size=1, shared_memory=False)

    def ReadReady(self, request, context):
        try:
            done, reason, nbytes, ms = self.consumer.read_ready(request)
        except Refused as exc:
            context.abort(exc.code, str(exc))
        if not done:
            return transfer_pb2.ReadResult(status=transfer_pb2.READ_FAILED, reason=reason)
        return transfer_pb2.ReadResult(status=transfer_pb2.READ_DONE, bytes_read=nbytes, read_ms=int(ms))

    def Heartbeat(self, request, context):
        try:
            unknown = self.consumer.heartbeat(request.layout_version, request.request_ids)
        except Refused as exc:
            context.abort(exc.code, str(exc))
        return transfer_pb2.PrefillHeartbeatReply(unknown_request_ids=unknown)

    def PrefillDone(self, request, context):
        # vLLM decodes compute the last prompt token themselves: the prefill's first token is not needed
        try:
            self.consumer.heartbeat(request.layout_version, [request.request_id])
        except Refused as exc:
            context.abort(exc.code, str(exc))
        return transfer_pb2.PrefillDoneReply(accepted=True)
