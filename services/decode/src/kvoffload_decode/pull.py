"""The decode's pull path, without the gRPC server: which prefill layouts are accepted, what a
ReadReady asks for, pulling the announced rows and installing them (``DecodeLoop.write_rows``),
the end of a prefill, and the counters of it all. ``TransferServicer`` turns proto requests into
``LayerPuller`` calls and its results and typed errors into replies and gRPC statuses.

A malformed or unknown message raises a ``PullRefused`` (and changes nothing); every well-formed
ReadReady gets an answer (``ReadOutcome``, done or failed), so the prefill's reuse gate never
waits forever. Same host: rows are read straight out of the prefill's shared-memory layer buffer;
other hosts: streamed from the prefill's LayerSource in bounded chunks (``pdlink.sources.RowSources``
keeps the attached segments and the channels). With transfer_backend "memfabric" every layer is read
through memfabric instead (``pdlink.memfabric.MemfabricRows``: both planes in one batched read from
the session the prefill's layout names), and a layout whose transfer_backend differs from this
decode's is refused. A failed read of the source (a dropped stream, a short read) is retried
(idempotently: the same rows land in the same place) up to ``read_retries`` times before the
answer is failed; a failed memfabric read (``MemfabricError``, its return code) is failed at once.
Heartbeats, ReadReady and PrefillDone are the news that keep a pending request's watchdog (see
``DecodeLoop``) quiet. Everything here may be called from many gRPC threads at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import structlog
import torch
from kvcore.layout import KVLayout, dtype_name
from kvcore.settings import tp_handshake_problem
from dsamodel.sampling import TokenLogprob
from kvoffload_proto.v1 import transfer_pb2
from pdlink.memfabric import MemfabricRows
from pdlink.sources import RowSources, read_with_retries

from kvoffload_decode.loop import DecodeLoop

log = structlog.get_logger(__name__)

# ---- counters ------------------------------------------------------------------------------------

COUNTERS = {  # name -> meaning (the names are what Stats and /metrics expose)
    "read_done": "ReadReady answered READ_DONE after a pull (a duplicate answered from installed rows is not)",
    "read_failed": "ReadReady answered READ_FAILED",
    "read_retries": "retries of a failed read of the source",
    "bytes_read": "bytes pulled and installed (main + indexer rows) by the READ_DONE pulls",
    "read_ms_total": "ms the READ_DONE pulls spent moving data (reading the source + installing the rows)",
    "reads_shared_memory": "plane reads out of the prefill's shared-memory buffer (retries included)",
    "reads_streamed": "plane reads streamed from the prefill's LayerSource (retries included)",
    "heartbeats": "Heartbeat messages taken",
}
# and, per prefill TP rank r whose rows this decode pulled, ``bytes_read_prefill_tp_rank_<r>``: the
# part of bytes_read read out of that rank's layer buffers (the ranks of a contributor group send
# their shares of every layer; the parts sum to bytes_read)
BY_RANK = "bytes_read_prefill_tp_rank_"


class PullCounters:
    """The pull path's counters (``COUNTERS``), safe to update from many threads: every change and
    every ``snapshot`` holds one lock, so a snapshot never shows half of an ``add``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = {name: 0 for name in COUNTERS}
        self._values["read_ms_total"] = 0.0

        self._by_rank: dict[int, float] = {}

    def increment(self, name: str) -> None:
        self.add(**{name: 1})

    def add_read(self, prefill_tp_rank: int, nbytes: int, ms: float) -> None:
        """One READ_DONE pull of ``nbytes`` out of prefill TP rank ``prefill_tp_rank``'s buffers."""
        with self._lock:
            self._values["read_done"] += 1
            self._values["bytes_read"] += nbytes
            self._values["read_ms_total"] += ms
            self._by_rank[prefill_tp_rank] = self._by_rank.get(prefill_tp_rank, 0) + nbytes

    def add(self, **amounts: float) -> None:
        """Add to one or more counters at once (KeyError, and nothing added, for an unknown name)."""
        unknown = [name for name in amounts if name not in self._values]
        if unknown:
            raise KeyError(f"unknown counter(s) {unknown}; known: {list(self._values)}")
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict[str, float]:
        """A copy of every counter, taken at one instant."""
        with self._lock:
            return {**self._values, **{f"{BY_RANK}{r}": b for r, b in sorted(self._by_rank.items())}}


# ---- outcomes and refusals -----------------------------------------------------------------------


class PullRefused(Exception):
    """A message the decode refuses outright; nothing was changed. The subclass says why."""


class NoAcceptedLayout(PullRefused):
    """The message names a ``layout_version`` no accepted ExchangeLayout gave."""


class MalformedRead(PullRefused):
    """A ReadReady whose layer, row range or destination cannot be right."""


class UnknownRequest(PullRefused):
    """The request is not waiting for KV here."""


@dataclass(frozen=True)
class ReadOutcome:
    """The answer to a well-formed ReadReady: done (``bytes_read``/``read_ms`` of the pull; 0 when
    the rows were already installed) or failed, with the ``reason``."""

    done: bool
    reason: str = ""
    bytes_read: int = 0
    read_ms: float = 0.0


# ---- the pull path ---------------------------------------------------------------------------------

class LayerPuller:
    """One decode rank's side of the transfer: the layouts it accepted (by ``layout_version``), the
    pulls of announced layers into ``loop`` (through ``sources``, with retries), the prefill's
    heartbeats and PrefillDone, and the ``counters``. With ``memfabric`` (transfer_backend "memfabric")
    every pull reads through it, never ``sources``."""

    def __init__(self, loop: DecodeLoop, layout: KVLayout, model_id: str, host_id: str, sources: RowSources,
                 read_retries: int = 2, memfabric: MemfabricRows | None = None, *, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        self.loop, self.layout, self.model_id, self.host_id = loop, layout, model_id, host_id
        self.tp_rank, self.tp_size = tp_rank, tp_size  # this decode rank: only its contributors' layouts
        self.sources, self.memfabric = sources, memfabric
        self.read_retries = read_retries
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
        log.info("layout_exchange", accepted=not reason, reason=reason, layout_version=m.layout_version,
                 data_endpoint=m.data_endpoint, prefill_tp_rank=m.prefill_tp_rank, prefill_tp_size=m.prefill_tp_size,
                 decode_tp_rank=self.tp_rank, decode_tp_size=self.tp_size)
        return reason

    def check_layout(self, m: transfer_pb2.LayoutMetadata) -> str:
        """"" if this decode can pull from a prefill with layout ``m``, else the first mismatch."""
        if m.layout_version == 0:
            return "layout_version: must be > 0"
        if m.model_id != self.model_id:
            return f"model_id: prefill serves {m.model_id!r}, this decode {self.model_id!r}"
        if m.num_layers != self.layout.num_layers or len(m.layers) != m.num_layers:
            return f"num_layers: prefill has {m.num_layers} ({len(m.layers)} described), decode {self.layout.num_layers}"
        if m.block_size != self.layout.block_size:
            return f"block_size: prefill {m.block_size}, decode {self.layout.block_size}"
        mine = "memfabric" if self.memfabric is not None else "kvoffload"
        theirs = "memfabric" if m.memfabric_session else "kvoffload"
        if mine != theirs:
            return (f"memfabric_session: the prefill's transfer_backend is {theirs!r} (session "
                    f"{m.memfabric_session or 'none'}), this decode's {mine!r}; both sides must use the same one")
        tp = tp_handshake_problem(m.prefill_tp_size, m.prefill_tp_rank, self.tp_size, self.tp_rank)
        if tp:
            return tp
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

    def same_host(self, host_id: str) -> bool:
        """Whether a prefill on ``host_id`` shares this decode's shared memory."""
        return host_id == self.host_id

    def accepted_layout(self, layout_version: int) -> transfer_pb2.LayoutMetadata:
        """The layout the prefill sent under ``layout_version``; NoAcceptedLayout without one."""
        with self._lock:
            meta = self._layouts.get(layout_version)
        if meta is None:
            raise NoAcceptedLayout(f"no accepted layout with layout_version {layout_version}: "
                                   "call ExchangeLayout first")
        return meta

    def layouts(self) -> dict[int, transfer_pb2.LayoutMetadata]:
        """A copy of the accepted layouts by ``layout_version``."""
        with self._lock:
            return dict(self._layouts)

    # ---- pulls ---------------------------------------------------------------------------------

    def read_ready(self, request: transfer_pb2.ReadReadyRequest) -> ReadOutcome:
        """Pull and install the announced rows. PullRefused (nothing changed, nothing pulled) for a
        malformed or unknown ReadReady; else the answer. Rows already installed (a retry or a
        duplicate) are not pulled again: the first result stands, counted once."""
        meta = self.accepted_layout(request.layout_version)
        if request.layer >= self.layout.num_layers or request.src_end < request.src_start:
            raise MalformedRead(f"layer {request.layer} (0..{self.layout.num_layers - 1}) or range "
                                f"[{request.src_start}, {request.src_end}) is malformed")
        req = self.loop.pending_request(request.request_id)
        if req is None:
            raise UnknownRequest(f"request {request.request_id!r} is not waiting for KV here")
        n = request.src_end - request.src_start
        if request.dst_start + n > req.num_prompt_tokens:
            raise MalformedRead(f"rows [{request.dst_start}, {request.dst_start + n}) go past the prompt's "
                                f"{req.num_prompt_tokens} tokens")
        self.loop.heard_from_prefill(request.request_id, f"prefill {meta.data_endpoint}")  # a well-formed report
        with self.loop.lock:
            installed = req.rows[request.layer]
        if n and request.dst_start + n <= installed:  # a retry or duplicate: the rows are here
            return ReadOutcome(done=True)
        try:
            t = time.perf_counter()
            kv, idx = self._read_with_retries(meta, request)
            copy_s = time.perf_counter() - t  # the pull's own data movement: read out of the
            copy_s += self.loop.write_rows(request.request_id, request.layer, request.dst_start, kv, idx)  # source, install
        except Exception as exc:  # answered, never left hanging: the prefill fails the slot's read
            self.counters.increment("read_failed")
            reason = f"pull of layer {request.layer} rows [{request.src_start}, {request.src_end}) failed: {exc!r}"
            log.warning("read_failed", request_id=request.request_id, layer=request.layer, reason=reason)
            return ReadOutcome(done=False, reason=reason)
        ms = copy_s * 1000
        nbytes = kv.numel() * kv.element_size() + idx.numel() * idx.element_size()
        self.counters.add_read(meta.prefill_tp_rank, nbytes, ms)
        return ReadOutcome(done=True, bytes_read=nbytes, read_ms=ms)

    def _read_with_retries(self, meta, request) -> tuple[torch.Tensor, torch.Tensor]:
        """``_read``, again after a failure (a dropped stream, a short read) up to ``read_retries``
        times while the request still waits (``pdlink.sources.read_with_retries``)."""
        def on_retry(attempt: int, exc: Exception) -> None:
            self.counters.increment("read_retries")
            log.warning("read_retry", request_id=request.request_id, layer=request.layer, attempt=attempt,
                        error=repr(exc))

        return read_with_retries(lambda: self._read(meta, request), self.read_retries,
                                 lambda: self.loop.pending_request(request.request_id) is not None, on_retry)

    def _read(self, meta, request) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [src_start, src_end) of one layer: (kv [n, W], indexer rows [n, Wi]) as the caches store
        them (``CacheSpec.storage``: the model dtype; an fp8 indexer's rows as bytes, keys + scales)."""
        spec = self.layout.layers[request.layer]
        lay = meta.layers[request.layer]
        if self.memfabric is not None:  # both planes in one batched memfabric read
            caches = (spec.main, spec.indexer)
            raws = self.memfabric.layer_rows(meta, request.src_start, request.src_end,
                                             [(lay.main_buffer, spec.main.row_bytes),
                                              (lay.indexer_buffer, spec.indexer.row_bytes)])
            kv, idx = (_rows(raw, cache) for raw, cache in zip(raws, caches))
            return kv, idx
        parts = []
        for kind, region, cache in ((transfer_pb2.PLANE_KIND_MAIN, lay.main_buffer, spec.main),
                                    (transfer_pb2.PLANE_KIND_INDEXER, lay.indexer_buffer, spec.indexer)):
            if self.same_host(meta.host_id) and region.segment_name:
                raw = self.sources.shared_rows(region, request.src_start, request.src_end, cache.row_bytes)
                self.counters.increment("reads_shared_memory")
            else:
                raw = self.sources.streamed_rows(meta.data_endpoint, request, kind, cache.row_bytes)
                self.counters.increment("reads_streamed")
            parts.append(_rows(raw, cache))
        return parts[0], parts[1]

    # ---- end of a prefill ----------------------------------------------------------------------

    def heartbeat(self, layout_version: int, request_ids: Iterable[str]) -> list[str]:
        """The prefill is alive and still working on ``request_ids``; returns those not pending here."""
        meta = self.accepted_layout(layout_version)
        peer = f"prefill {meta.data_endpoint}"
        unknown = [rid for rid in request_ids if not self.loop.heard_from_prefill(rid, peer)]
        self.counters.increment("heartbeats")
        return unknown

    def prefill_done(self, layout_version: int, request_id: str, num_prompt_tokens: int, first_token: int,
                     first_logprob: TokenLogprob | None = None, draft_token: int | None = None) -> str:
        """The prefill finished the request: "" when its first token (and, when the request asked for
        them, its log-probabilities; and its MTP draft when one came) is taken, else why not.
        UnknownRequest if the request is not pending here."""
        meta = self.accepted_layout(layout_version)
        reason = self.premature(request_id, num_prompt_tokens, first_token)
        if not reason:
            self.loop.heard_from_prefill(request_id, f"prefill {meta.data_endpoint}")
        try:
            return reason or self.loop.prefill_done(request_id, num_prompt_tokens, first_token, first_logprob,
                                                    draft_token)
        except KeyError:
            raise UnknownRequest(f"request {request_id!r} is not waiting for KV here") from None

    def premature(self, request_id: str, num_prompt_tokens: int, first_token: int) -> str:
        """Why a PrefillDone cannot be taken yet ("" if it can): the prefill sends it only after every
        layer's READ_DONE, so a missing layer means it came early; a first token is never replaced."""
        with self.loop.lock:
            req = self.loop.pending.get(request_id)
            if req is None or num_prompt_tokens != req.num_prompt_tokens:
                return ""  # prefill_done names these
            missing = next(((i, r) for i, r in enumerate(req.rows) if r < req.num_prompt_tokens), None)
            if missing is not None:
                return (f"layer {missing[0]} has {missing[1]} of {req.num_prompt_tokens} rows: PrefillDone must "
                        "follow every layer's READ_DONE")
            if req.first_token is not None and req.first_token != first_token:
                return f"the first token is already {req.first_token} (this PrefillDone says {first_token})"
            return ""

    def close(self) -> None:
        self.sources.close()
        if self.memfabric is not None:
            self.memfabric.close()


def _rows(raw: torch.Tensor, cache) -> torch.Tensor:
    """Raw bytes [n, row_bytes] of one cache -> its rows as stored ([n, W] of ``cache.storage``)."""
    dtype, width = cache.storage
    return raw.view(dtype).view(-1, width)


__all__ = ["COUNTERS", "LayerPuller", "MalformedRead", "NoAcceptedLayout", "PullCounters", "PullRefused",
           "ReadOutcome", "UnknownRequest"]
