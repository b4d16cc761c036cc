"""The remote D2H producer inside a vLLM prefill worker: announce each layer, serve its blocks.

At a step's first layer the scheduler's sends are taken up (vLLM may start a step's loads only
after its forward, so not in ``start_load_kv``): a link (``pdlink.links.DecodeLink``) per
decode endpoint exchanges the layout once, then holds the request (its heartbeats keep the decode's
watchdog quiet while anything of it is outstanding). After each layer's attention
(``layer_saved``) every send of the step is announced for that layer (ReadReady, answered when the
decode pulled it); the forward does not wait. The decode pulls through this worker's LayerSource
gRPC server, which streams whole blocks straight out of vLLM's cache tensor (rows of a vLLM block
are not token-contiguous, so only ranges aligned to the layer's block size are served), through the
block ids of the layer's KV cache group in the request's latest send (``kvoffload_vllm.d2h_layers``):
the scheduler's ids, never the worker's attention metadata, whose sliding-window table keeps stale
ids of blocks vLLM nulled and may have handed to another group. vLLM's null block is never served.
A request is reported finished (``finished``) once vLLM finished it and every announce of it was
answered, READ_DONE or not; only then may vLLM free its blocks. Each announce holds its layer at the
reuse gate (``kvoffload_vllm.reuse_gate``) until it is answered: with shared layer buffers, the next layer of
the buffer is not written before the decode pulled this one. Its log line says how many layers the
decode had pulled before the last layer of their step was announced (``layers_read_during_forward``:
the pull is layerwise). With ``transfer_backend: "mooncake"`` the decode reads the blocks through
Mooncake Transfer Engine instead (``kvoffload_vllm.d2h_engine``: vLLM's cache memory registered with
this worker's engine, each layer's block addresses in the layout, each announce naming its blocks).
Under tensor parallel each rank's producer feeds the decode rank it contributes to
(``kvoffload_vllm.d2h_tp``): its head slice of every row, or, where every rank holds the same KV,
its share of the step's blocks; its layout names its rank.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import structlog
import torch

from kvcore.pool.segment import host_id
from kvoffload_proto.v1 import transfer_pb2, transfer_pb2_grpc
from kvoffload_vllm.d2h_engine import start_d2h_engine
from kvoffload_vllm.d2h_layers import D2HLayers
from kvoffload_vllm.d2h_plan import Send, blocks_of
from kvoffload_vllm.d2h_settings import D2HSettings
from kvoffload_vllm.d2h_tp import Contribution, announced_rows, contribution
from kvoffload_vllm.kv_groups import NULL_BLOCK
from kvoffload_vllm.reuse_gate import GATE
from kvoffload_vllm.stats import Counters
from pdlink.layer_source import LayerSourceServicer, RowBuffer
from pdlink.layout_messages import EngineShare, layout_metadata
from pdlink.links import DecodeLink, LinkError
from pdlink.refusals import MalformedRead, Refused, UnknownRequest
from svcruntime.tls import add_port

log = structlog.get_logger("vllm.kvoffload.producer")

PULL_MARGIN_S = 5.0  # past the ReadReady timeout, for the answer to reach the reuse gate

COUNTERS = {
    "requests_sent": "prefill requests whose KV a decode pulls",
    "layers_announced": "layer announcements (ReadReady) to decodes, one per step and layer",
    "reads_done": "announcements the decode answered READ_DONE",
    "reads_failed": "announcements answered READ_FAILED, refused, or not answered in time",
    "blocks_served": "blocks (of one layer) streamed to decodes by the LayerSource",
    "bytes_served": "bytes streamed to decodes by the LayerSource",
    "layers_read_during_forward": "layers a decode had pulled before the last layer of their step was announced",
}


class _StepClock:
    """When the step's latest layer was announced; after the step, its last layer's."""

    last_layer_at = float("inf")


@dataclass
class _Outgoing:
    """One request being read by its decode."""

    req_id: str
    send: Send
    generation: int
    link: DecodeLink | None
    part: Contribution  # which decode rank this rank feeds, and its share
    outstanding: int = 0  # announces not answered yet
    failed: list[str] = field(default_factory=list)
    finished: bool = False  # vLLM finished the request
    answers: list[tuple[_StepClock, float]] = field(default_factory=list)  # READ_DONE: (its step, when)

    def read_during_forward(self) -> int:
        """Layers the decode had pulled before the last layer of their step was announced."""
        return sum(1 for clock, at in self.answers if at < clock.last_layer_at)


class _Announce:
    """The ``pdlink.links.ReadTicket`` of one announce: its answer settles the request's count."""

    def __init__(self, producer: Producer, out: _Outgoing, layer: int, clock: _StepClock) -> None:
        self.producer, self.out, self.layer, self.generation = producer, out, layer, out.generation
        self.clock = clock

    def read_done(self, reader) -> None:
        self.producer._answered(self.out, self.layer, "", self.clock)

    def read_failed(self, reader, reason: str) -> None:
        self.producer._answered(self.out, self.layer, reason or "READ_FAILED", self.clock)


class Producer(RowBuffer):
    def __init__(self, settings: D2HSettings, model_id: str, layers: D2HLayers) -> None:
        self.settings, self.layers = settings, layers
        self._lock = threading.Lock()
        self._reqs: dict[str, _Outgoing] = {}  # by transfer id (the decode's and the proxy's name)
        self._by_req: dict[str, str] = {}  # vLLM request id -> transfer id
        self._links: dict[str, DecodeLink] = {}
        self._step: list[_Outgoing] | None = None  # this step's sends, from its first layer on
        self._announced_at: list[float] = []
        self._clock = _StepClock()
        self._generation = 0
        self.counters = Counters(COUNTERS)
        self.transfer = start_d2h_engine(settings, "Prefill", layers)  # before the server: a failed start leaves none
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvoffload-source"),
            options=[("grpc.so_reuseport", 0)],  # a second bind of the data port fails (see the consumer's)
        )
        transfer_pb2_grpc.add_LayerSourceServicer_to_server(LayerSourceServicer(self), self._server)
        port = add_port(self._server, f"{settings.advertise_host}:{settings.data_port}")
        if not port:
            raise RuntimeError(f"cannot bind the LayerSource at {settings.advertise_host}:{settings.data_port}")
        self._server.start()
        self.data_endpoint = f"{settings.advertise_host}:{port}"
        self.metadata = layout_metadata(
            model_id=model_id,
            layers=layers.layer_layouts(engine_blocks=self.transfer is not None),
            block_size=layers.groups[0].block_size,
            tp_rank=settings.tp_rank,
            tp_size=settings.tp_size,
            data_endpoint=self.data_endpoint,
            host_id=host_id(),
            version=secrets.randbits(62) + 1,  # vLLM seeds `random`
            engine=EngineShare(self.transfer.name, self.transfer.session) if self.transfer else None,
        )
        log.info(
            "kvoffload_d2h_producer",
            data_endpoint=self.data_endpoint,
            layers=len(layers.names),
            block_sizes=[g.block_size for g in layers.groups],
            layout_version=self.metadata.layout_version,
            tp_rank=settings.tp_rank,
            tp_size=settings.tp_size,
            kv_replicated=settings.kv_replicated,
            transfer_backend=settings.transfer_backend,
            engine_session=self.metadata.engine_session,
        )

    # ---- a step ------------------------------------------------------------------------------

    def _link(self, endpoint: str) -> DecodeLink:
        link = self._links.get(endpoint)
        if link is None:
            link = self._links[endpoint] = DecodeLink(
                endpoint, self.metadata, self.settings.read_timeout_s, peer_timeout_s=self.settings.peer_timeout_s
            )
        link.ensure_layout()
        return link

    def _open(self, send: Send) -> tuple[DecodeLink | None, Contribution]:
        """The link to the decode rank this rank feeds for ``send``'s request (None, logged, when the
        ranks do not pair or the link fails: the decode's watchdog fails the request), and the part."""
        s, tid = self.settings, send.peer.transfer_id
        try:
            part = contribution(send.peer, s.tp_rank, s.tp_size, s.kv_replicated)
        except ValueError as exc:
            log.error("kvoffload_d2h_tp_mismatch", request_id=send.req_id, transfer_id=tid, error=str(exc))
            return None, Contribution(send.peer.endpoint, 0, 1, False)
        try:
            return self._link(part.endpoint), part
        except LinkError as exc:
            log.error("kvoffload_d2h_link_failed", request_id=send.req_id, transfer_id=tid, error=str(exc))
            return None, part

    def _begin_step(self, meta) -> None:
        self._step, self._clock = [], _StepClock()
        for send in meta.sends:
            tid = send.peer.transfer_id
            with self._lock:
                out = self._reqs.get(tid)
            if out is None:
                link, part = self._open(send)
                with self._lock:
                    self._generation += 1
                    out = self._reqs[tid] = _Outgoing(send.req_id, send, self._generation, link, part)
                    self._by_req[send.req_id] = tid
                if link is not None:
                    link.hold(tid)
                self.counters.add(requests_sent=1)
            with self._lock:
                out.send = send  # the step's tokens and the request's blocks so far
            if out.link is not None:
                self._step.append(out)

    def layer_saved(self, layer_name: str, meta) -> None:
        """Layer ``layer_name``'s attention wrote this step's tokens: announce it for every send."""
        if self._step is None:
            self._begin_step(meta)
        if not self._step:
            return
        layer = self.layers.index(layer_name)
        group, bs = self.layers.group_of[layer], self.layers.block_size(layer)
        for out in self._step:
            start, end = announced_rows(out.send.start, out.send.end, bs, out.part)
            if start == end:  # copies: the step's blocks of this layer are other contributors' share
                continue
            with self._lock:
                out.outstanding += 1
            # the layer's blocks may sit in a shared buffer: its next layer waits until this pull is answered
            GATE.hold(layer_name, "pull", self.settings.read_timeout_s + PULL_MARGIN_S)
            assert out.link is not None  # a step holds the sends with a link only (_begin_step)
            try:
                out.link.announce(
                    _Announce(self, out, layer, self._clock),
                    None,
                    out.send.peer.transfer_id,
                    start,
                    end,
                    self._announced_blocks(out.send, start, end, group, bs),
                )
            except Exception as exc:  # noqa: BLE001 - never sent: a failed read, so its gate hold is released
                self._answered(out, layer, f"announce failed: {exc}", self._clock)
        self._announced_at.append(time.perf_counter())
        self._clock.last_layer_at = self._announced_at[-1]
        self.counters.add(layers_announced=1)

    def _announced_blocks(self, send: Send, start: int, end: int, group: int, bs: int) -> tuple[int, ...]:
        """With a transfer engine: the send's blocks of ``group`` that hold rows ``[start, end)``
        (``src_block_ids``)."""
        if self.transfer is None:
            return ()
        blocks = blocks_of(start, end, bs)
        return send.block_ids[group][blocks.start : blocks.stop]

    def end_step(self) -> None:
        if self._announced_at and self._step:  # announced: the step has sends
            log.info(
                "kvoffload_d2h_step_announced",
                layers=len(self._announced_at),
                forward_s=round(self._announced_at[-1] - self._announced_at[0], 4),
                request_ids=[o.req_id for o in self._step],
                transfer_ids=[o.send.peer.transfer_id for o in self._step],
                tokens=[[o.send.start, o.send.end] for o in self._step],
            )
        self._step, self._announced_at = None, []

    def _answered(self, out: _Outgoing, layer: int, failure: str, clock: _StepClock) -> None:
        at = time.perf_counter()
        GATE.release(self.layers.names[layer], "pull")
        with self._lock:
            out.outstanding -= 1
            if failure:
                out.failed.append(failure)
            else:
                out.answers.append((clock, at))
        self.counters.add(reads_done=0 if failure else 1, reads_failed=1 if failure else 0)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """vLLM request ids whose blocks may be freed now: finished, and every announce answered."""
        done: list[_Outgoing] = []
        with self._lock:
            for rid in finished_req_ids:
                tid = self._by_req.get(rid)
                if tid is not None:
                    self._reqs[tid].finished = True
            for tid, out in list(self._reqs.items()):
                if out.finished and out.outstanding == 0:
                    done.append(self._reqs.pop(tid))
                    self._by_req.pop(out.req_id, None)
        for out in done:
            tid = out.send.peer.transfer_id
            during = out.read_during_forward()
            self.counters.add(layers_read_during_forward=during)
            if out.link is not None:
                out.link.release(tid)
            if out.failed:
                log.warning(
                    "kvoffload_d2h_reads_failed",
                    request_id=out.req_id,
                    transfer_id=tid,
                    failures=len(out.failed),
                    first=out.failed[0],
                )
            else:
                log.info(
                    "kvoffload_d2h_sent",
                    request_id=out.req_id,
                    transfer_id=tid,
                    tp_rank=self.settings.tp_rank,
                    decode=out.part.endpoint,
                    tokens=out.send.end,
                    layers_read=len(out.answers),
                    layers_read_during_forward=during,
                )
        return {out.req_id for out in done}

    # ---- the data path -----------------------------------------------------------------------

    def rows(self, request) -> torch.Tensor:
        """Its LayerSource's ``RowBuffer``: the bytes of the blocks that rows ``[src_start, src_end)`` of
        one layer of a request cover; ``Refused`` (with the gRPC status) when they cannot be served."""
        if request.layout_version != self.metadata.layout_version:
            raise Refused(
                f"layout_version {request.layout_version} is not this prefill's ({self.metadata.layout_version})",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if request.kind != transfer_pb2.PLANE_KIND_MAIN:
            raise MalformedRead("this prefill has no indexer plane (vLLM's KV only)")
        if request.layer >= len(self.layers.names):
            raise MalformedRead(f"layer {request.layer}: this prefill has {len(self.layers.names)} layers")
        bs = self.layers.block_size(request.layer)
        if request.src_start % bs or request.src_end % bs:
            raise MalformedRead(
                f"layer {request.layer} range [{request.src_start}, {request.src_end}) is malformed "
                f"(vLLM blocks: block-aligned ranges of {bs} rows only)"
            )
        blocks = blocks_of(request.src_start, request.src_end, bs)
        ids = torch.tensor(self._block_ids(request, blocks), dtype=torch.long)
        data = self.layers.pages[request.layer].index_select(0, ids)
        self.counters.add(blocks_served=len(ids), bytes_served=data.numel())
        return data.view(-1)

    def _block_ids(self, request, blocks: range) -> tuple[int, ...]:
        """The vLLM block ids of ``blocks`` of the request's layer, from its latest send; ``Refused`` for a
        request not sent from here, another generation, blocks it lacks or vLLM's null block."""
        group = self.layers.group_of[request.layer]
        with self._lock:
            out = self._reqs.get(request.request_id)
            if out is None:
                raise UnknownRequest(f"request {request.request_id!r} is not being sent here")
            if out.generation != request.generation:
                raise Refused(
                    f"request {request.request_id!r} is generation {out.generation}, not {request.generation}",
                    grpc.StatusCode.FAILED_PRECONDITION,
                )
            block_ids = out.send.block_ids[group]
        if blocks.stop > len(block_ids):
            raise Refused(
                f"rows up to {request.src_end}: the request holds {len(block_ids)} blocks of KV cache group {group}",
                grpc.StatusCode.OUT_OF_RANGE,
            )
        ids = block_ids[blocks.start : blocks.stop]
        if NULL_BLOCK in ids:  # a sliding window's block vLLM freed: its bytes may be another group's now
            raise Refused(
                f"layer {request.layer} ({self.layers.names[request.layer]}): block "
                f"{blocks.start + ids.index(NULL_BLOCK)} of KV cache group {group} is out of the sliding window "
                "(vLLM's null block): not served",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        return ids

    def take_counters(self) -> dict[str, float]:
        """The sums since the last report."""
        return self.counters.take()

    def close(self) -> None:
        self._server.stop(grace=1.0)
        for link in self._links.values():
            link.close()
        if self.transfer is not None:
            self.transfer.close()
