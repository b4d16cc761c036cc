"""The remote D2H consumer inside a vLLM decode worker: register, pull each layer, report.

Per new request (``begin_step``): a thread POSTs this worker's control endpoint to the proxy's
``/v1/metaserver`` (the proxy answers once the prefill answered). The Transfer gRPC server on the
control port takes the prefill's layout (checked against this engine's: model and vLLM layout
digest, layers, each layer's block size, row bytes, dtype; a mismatch is refused naming both
sides), its ReadReady announcements and heartbeats. A ReadReady pulls from the prefill's LayerSource
(``pdlink.sources.RowSources``) the whole blocks of the layer's KV cache group that improve on what
landed (``kvoffload_vllm.d2h_plan.Coverage``, one per group) and writes them into the request's
vLLM blocks of that group, then answers READ_DONE. A block this decode does not need (its own
prefix-cache hit, or its null block where a sliding window skips one) is neither pulled nor written.
With ``transfer_backend: "mooncake"`` the blocks are read through this worker's Mooncake Transfer
Engine instead, straight into the request's blocks (``read_in_place``, ``kvoffload_vllm.d2h_engine``:
the prefill's block ids of each announced range come with its ReadReady); a prefill on another
transfer backend is refused naming both.

Under tensor parallel each rank's consumer takes its own part: decode rank t pulls from its prefill
contributors only (``kvcore.pdpair``), each prefill rank's head slice of every block, or its share
of the blocks where every rank holds the same KV (``kvoffload_vllm.d2h_tp``); every rank registers
the same decode (rank 0's port, the TP size) with the proxy.

A request ends in exactly one of three ways, each reported once by ``finished`` after no pull is
writing its blocks any more: every layer landed (a finished receive); a pull failed, the
registration failed, or the prefill went silent for longer than ``peer_timeout_s`` once the
prefill had started (a failed receive: vLLM recomputes or fails it, I5); vLLM finished it while
it was loading (a client gone: a finished receive, so vLLM frees the blocks).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import structlog
import torch

from kvcore.hotcache.gather import write_pages
from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc
from kvoffload_vllm.d2h_engine import read_blocks, start_d2h_engine
from kvoffload_vllm.d2h_layers import D2HLayers
from kvoffload_vllm.d2h_layout import layer_slice, layout_problem
from kvoffload_vllm.d2h_plan import blocks_of
from kvoffload_vllm.d2h_settings import D2HSettings
from kvoffload_vllm.d2h_step import D2HStepMetadata
from kvoffload_vllm.d2h_tp import HeadSlice, sliced
from kvoffload_vllm.incoming import Incoming, RequestEnded
from kvoffload_vllm.kv_digest import prompt_digests
from kvoffload_vllm.kv_groups import NULL_BLOCK
from kvoffload_vllm.stats import Counters
from pdlink.pull_consumer import Plane, PullConsumer, Read, ReadOutcome, RowSink
from pdlink.pullcounters import COUNTERS as PULL_COUNTERS
from pdlink.refusals import MalformedRead, UnknownRequest
from pdlink.registration import Registration, post
from pdlink.sources import RowSources
from pdlink.transfer_service import TransferServicer
from svcruntime.tls import PROCESS, add_port, secure_or_insecure_channel

log = structlog.get_logger("vllm.kvoffload.consumer")

SINK_COUNTERS = {
    "requests_pulled": "decode requests whose prompt KV landed completely",
    "requests_failed": "decode requests whose pull failed (vLLM recomputes or fails them)",
    "requests_cancelled": "decode requests vLLM finished while their KV was loading",
    "blocks_pulled": "blocks (of one layer) written into vLLM's cache",
}
COUNTERS = {**SINK_COUNTERS, **PULL_COUNTERS}  # the pulls' own counters: pdlink.pullcounters
READ_RETRIES = 2
WATCHDOG_S = 0.25
REGISTRATION_TIMEOUT_S = 1800.0  # a backstop: the proxy answers within its own request deadline


class Consumer(RowSink):
    """The requests this worker receives, the ``RowSink`` its pulls write into (vLLM's blocks), and
    the control port (``pdlink``'s ``TransferServicer`` over a ``PullConsumer``)."""

    def __init__(self, settings: D2HSettings, model_id: str, layers: D2HLayers) -> None:
        self.settings, self.model_id, self.layers = settings, model_id, layers
        self._lock = threading.Lock()
        self._reqs: dict[str, Incoming] = {}  # by transfer id
        self._by_req: dict[str, str] = {}  # vLLM request id -> transfer id
        self.num_layers, self.block_size = len(layers.names), layers.groups[0].block_size
        self.counters = Counters(SINK_COUNTERS)
        self.transfer = start_d2h_engine(settings, "Decode", layers)
        if self.transfer is not None:
            self.transfer_engine = self.transfer.name
        sources = RowSources(lambda endpoint: secure_or_insecure_channel(endpoint, PROCESS))
        self.pull = PullConsumer(
            self,
            sources,
            model_id=model_id,
            read_retries=READ_RETRIES,
            tp_rank=settings.tp_rank,
            tp_size=settings.tp_size,
        )
        self._stop = threading.Event()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvoffload-transfer"),
            # a second decode on this kv_port fails to bind: with gRPC's default SO_REUSEPORT the kernel
            # would split the prefills' connections between the two, and announces reach the wrong decode
            options=[("grpc.so_reuseport", 0)],
        )
        transfer_pb2_grpc.add_TransferServicer_to_server(TransferServicer(self.pull), self._server)
        self.endpoint = f"{settings.advertise_host}:{settings.control_port}"
        try:
            bound = add_port(self._server, self.endpoint)
        except RuntimeError:  # grpcio raises where older releases returned 0
            bound = 0
        if not bound:
            raise RuntimeError(
                f"cannot bind the decode control port {self.endpoint} (kv_port + dp_rank x tp + tp_rank): "
                "another process holds it"
            )
        self._server.start()
        self._watchdog = threading.Thread(target=self._watch, name="kvoffload-watchdog", daemon=True)
        self._watchdog.start()
        log.info(
            "kvoffload_d2h_consumer",
            control_endpoint=self.endpoint,
            tp_rank=settings.tp_rank,
            tp_size=settings.tp_size,
            layers=len(layers.names),
            block_sizes=[g.block_size for g in layers.groups],
            peer_timeout_s=settings.peer_timeout_s,
            transfer_backend=settings.transfer_backend,
            engine_session=self.transfer.session if self.transfer else "",
        )

    # ---- the scheduler's news ----------------------------------------------------------------

    def begin_step(self, meta: D2HStepMetadata) -> None:
        for recv in meta.recvs:
            inc = Incoming.of(recv, self.layers.groups, self.num_layers)
            with self._lock:
                self._reqs[recv.transfer_id] = inc
                self._by_req[recv.req_id] = recv.transfer_id
            threading.Thread(target=self._register, args=(inc,), name="kvoffload-register", daemon=True).start()
        for rid in meta.cancelled:
            with self._lock:
                tid = self._by_req.get(rid)
                ended = self._reqs.get(tid) if tid else None
                if ended is not None and ended.state == "loading":
                    ended.state, ended.reason = "cancelled", "vLLM finished the request while its KV was loading"

    def _register(self, inc: Incoming) -> None:
        """Register at the proxy's metaserver (``pdlink.registration``); the prefill is due after."""
        recv, s = inc.recv, self.settings
        assert s.base_port is not None  # a kv_consumer always has its control port (d2h_settings)
        reg = Registration(
            recv.transfer_id, recv.metaserver, recv.token, s.advertise_host, s.base_port, s.tp_size, s.dp_rank
        )
        problem = post(reg, timeout_s=REGISTRATION_TIMEOUT_S, stop=self._stop)
        if problem:
            self._fail(recv.transfer_id, problem)
            return
        with self._lock:
            if inc.state == "loading" and not inc.last_news:
                inc.last_news = time.monotonic()  # the prefill answered: its reads are due now
        log.info(
            "kvoffload_d2h_registered",
            request_id=recv.req_id,
            transfer_id=recv.transfer_id,
            seconds=round(time.monotonic() - inc.started, 3),
        )

    def _fail(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            inc = self._reqs.get(transfer_id)
            if inc is None or inc.state != "loading":
                return
            inc.state, inc.reason = "failed", reason
        log.warning(
            "kvoffload_d2h_load_failed",
            request_id=inc.recv.req_id,
            transfer_id=transfer_id,
            reason=reason,
            layers_done=inc.layers_done(),
        )

    def _watch(self) -> None:
        while not self._stop.wait(WATCHDOG_S):
            now = time.monotonic()
            with self._lock:
                silent = [
                    (tid, inc.peer, now - inc.last_news)
                    for tid, inc in self._reqs.items()
                    if inc.state == "loading" and inc.last_news and now - inc.last_news > self.settings.peer_timeout_s
                ]
            for tid, peer, quiet in silent:
                self._fail(
                    tid,
                    f"prefill {peer or '(none announced)'} silent for {quiet:.1f} s "
                    f"(peer_timeout_s {self.settings.peer_timeout_s:g})",
                )

    def finished(self) -> tuple[set[str], set[str]]:
        """(vLLM ids whose KV landed or that were cancelled, ids whose load failed), each once."""
        done: set[str] = set()
        failed: set[str] = set()
        ended: list[Incoming] = []
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
                log.info(
                    "kvoffload_d2h_pulled",
                    request_id=inc.recv.req_id,
                    transfer_id=inc.recv.transfer_id,
                    tokens=inc.recv.num_tokens,
                    bytes=inc.bytes,
                    bytes_by_prefill_tp_rank=dict(sorted(inc.bytes_by_rank.items())),
                    tp_rank=self.settings.tp_rank,
                    layer_blocks=inc.layer_blocks,
                    seconds=seconds,
                    prefill=inc.peer,
                    **self._digests(inc),
                )
            elif inc.state == "failed":
                self.counters.add(requests_failed=1)
            else:
                self.counters.add(requests_cancelled=1)
                log.info("kvoffload_d2h_cancelled", request_id=inc.recv.req_id, transfer_id=inc.recv.transfer_id)
        return done, failed

    def _digests(self, inc: Incoming) -> dict[str, object]:
        """With ``kv_digests``: each layer's digest of the prompt KV that landed (read before vLLM is told
        it did, so nothing computed over it yet; ``kvoffload_vllm.kv_digest``)."""
        if not self.settings.kv_digests:
            return {}
        digests, spans = prompt_digests(self.layers, inc.recv.block_ids, inc.recv.num_tokens)
        return {"kv_digests": digests, "kv_digest_blocks": spans}

    # ---- the RowSink hooks (pdlink.pull_consumer): the prefill's calls --------------------------------

    def layer_block_size(self, layer: int) -> int:
        return self.layers.block_size(layer)

    def layout_problem(self, m: transfer_pb2.LayoutMetadata) -> str:
        return layout_problem(m, self.layers, self.settings, in_place=self.transfer is not None)

    def planes(self, layer: int) -> list[Plane]:
        return [Plane(transfer_pb2.PLANE_KIND_MAIN, self.layers.row_bytes(layer))]

    def begin(self, read: Read) -> range | ReadOutcome:
        """Whole blocks: of the announced rows, the blocks of the layer's group that improve on what landed."""
        r = read.request
        if r.dst_start != r.src_start:
            raise MalformedRead(
                f"rows [{r.src_start}, {r.src_end}) -> {r.dst_start}: a vLLM decode takes each row "
                "at the prefill's position"
            )
        with self._lock:
            inc = self._reqs.get(r.request_id)
            if inc is None:
                raise UnknownRequest(f"request {r.request_id!r} is not waiting for KV here")
            if r.src_end > inc.recv.num_tokens:
                raise MalformedRead(f"rows up to {r.src_end} go past the prompt's {inc.recv.num_tokens} tokens")
            if inc.state == "done":  # a late copy of tokens that all landed already
                return ReadOutcome(done=True)
            if inc.state != "loading":
                return ReadOutcome(done=False, reason=inc.reason or f"request {r.request_id!r} is {inc.state}")
            inc.last_news, inc.peer = time.monotonic(), read.endpoint
            inc.busy += 1
        part, row = self._part(read)
        with inc.write_lock:
            problem = inc.slice_into(part.count, self.layers.groups)
            coverage = inc.coverages[self.layers.group_of[r.layer]]
            idx = coverage.to_write(row, r.src_start, r.src_end) if not problem else torch.empty(0)
        if problem:
            self.end(read)
            return ReadOutcome(done=False, reason=problem)
        if not len(idx):  # a retry, a duplicate, or blocks this decode does not need
            self.end(read)
            return ReadOutcome(done=True)
        bs = self.layers.block_size(r.layer)
        first = r.src_start // bs
        return range((first + int(idx[0])) * bs, (first + int(idx[-1]) + 1) * bs)

    def _part(self, read: Read) -> tuple[HeadSlice, int]:
        """The head slice of each block ``read``'s prefill rank fills, and its coverage row."""
        part = layer_slice(read.meta, read.layer, self.layers, self.settings.tp_size)
        assert not isinstance(part, str)  # layout_problem accepted the layout
        return part, self.layers.plane_of[read.layer] * part.count + part.index

    def wanted(self, transfer_id: str) -> bool:
        with self._lock:
            inc = self._reqs.get(transfer_id)
            return inc is not None and inc.state == "loading"

    def install(self, read: Read, rows: range, planes: list[torch.Tensor]) -> float:
        """Write the pulled blocks that improve on what landed into the request's vLLM blocks of the
        layer's group."""
        r, lay = read.request, self.layers
        part = self._part(read)[0]
        data = planes[0].view(-1, lay.page_bytes(r.layer) // part.count)
        first = rows.start // lay.block_size(r.layer)
        target = sliced(lay.pages[r.layer], part)

        def copy(ids: torch.Tensor, blocks: torch.Tensor) -> int:
            write_pages(target, ids, data.index_select(0, blocks - first))
            return int(data.numel())

        return self._write(read, rows, copy)[1]

    def read_in_place(self, read: Read, rows: range) -> tuple[int, float]:
        """With a transfer engine: read the blocks that improve on what landed straight from the
        prefill's blocks (named by the ReadReady's ``src_block_ids``) into the request's."""
        r, transfer = read.request, self.transfer
        assert transfer is not None  # transfer_engine is set only with it
        announced = blocks_of(r.src_start, r.src_end, self.layers.block_size(r.layer))
        if len(r.src_block_ids) != len(announced):
            raise ValueError(
                f"the ReadReady names {len(r.src_block_ids)} prefill blocks for rows [{r.src_start}, "
                f"{r.src_end}), which are {len(announced)} blocks of layer {r.layer}"
            )
        src_all = torch.tensor(r.src_block_ids, dtype=torch.long)

        def copy(ids: torch.Tensor, blocks: torch.Tensor) -> int:
            src = src_all[blocks - announced.start]
            if bool((src == NULL_BLOCK).any()):
                raise ValueError(
                    f"layer {r.layer} ({self.layers.names[r.layer]}): the prefill's block "
                    f"{int(blocks[src == NULL_BLOCK][0])} of KV cache group {self.layers.group_of[r.layer]} is out "
                    "of its sliding window (vLLM's null block): not read"
                )
            return read_blocks(transfer, read.meta, r.layer, src, self.layers.pages[r.layer], ids)

        return self._write(read, rows, copy)

    def _write(self, read: Read, rows: range, copy) -> tuple[int, float]:
        """Under the request's write lock: ``copy(ids, blocks)`` the blocks of ``rows`` that improve on
        what landed (``blocks``: their indices in the request, ``ids``: its vLLM blocks of the layer's
        group), returning the bytes moved; then count them landed. (bytes, seconds)."""
        r, lay = read.request, self.layers
        group, row, bs = lay.group_of[r.layer], self._part(read)[1], lay.block_size(r.layer)
        with self._lock:
            inc = self._reqs[r.request_id]
        pulled = range(rows.start // bs, rows.stop // bs)
        t = time.perf_counter()
        # vLLM's caches, and what begin_step made under vLLM's inference mode, are inference tensors
        with inc.write_lock, torch.inference_mode():
            if inc.state != "loading":
                raise RequestEnded(inc.reason or f"request {r.request_id!r} is {inc.state}")
            coverage = inc.coverages[group]
            idx = coverage.to_write(row, r.src_start, r.src_end)  # at most begin's: coverage only grows
            blocks = idx + r.src_start // bs
            kept = (blocks >= pulled.start) & (blocks < pulled.stop)
            idx, blocks = idx[kept], blocks[kept]
            nbytes = copy(inc.block_ids[group][blocks], blocks)
            coverage.landed(row, r.src_start, r.src_end, idx)
            inc.layer_blocks[r.layer] += len(idx)
            complete = inc.complete
        self.counters.add(blocks_pulled=len(idx))
        with self._lock:
            inc.bytes += nbytes
            rank = read.meta.prefill_tp_rank
            inc.bytes_by_rank[rank] = inc.bytes_by_rank.get(rank, 0) + nbytes
            if complete and inc.state == "loading":
                inc.state = "done"
        return nbytes, time.perf_counter() - t

    def failed(self, read: Read, reason: str) -> None:
        self._fail(read.request_id, reason)  # vLLM recomputes or fails the request (I5)

    def end(self, read: Read) -> None:
        with self._lock:
            self._reqs[read.request_id].busy -= 1

    def heard(self, transfer_id: str, endpoint: str) -> bool:
        with self._lock:
            inc = self._reqs.get(transfer_id)
            if inc is None or inc.state != "loading":
                return False
            inc.last_news = time.monotonic()
            return True

    def prefill_done(self, request: transfer_pb2.PrefillDoneRequest, endpoint: str) -> str:
        # vLLM decodes compute the last prompt token themselves: the prefill's first token is not needed
        self.heard(request.request_id, endpoint)
        return ""

    def take_counters(self) -> dict[str, float]:
        """The sums since the last report: this sink's counters and the pulls' (``COUNTERS``)."""
        return {**self.counters.take(), **self.pull.counters.take()}

    def close(self) -> None:
        self._stop.set()
        self._server.stop(grace=1.0)
        self.pull.close()
        if self.transfer is not None:
            self.transfer.close()
