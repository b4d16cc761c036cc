"""Layerwise prefill: a prompt, chunk by chunk and layer by layer, through shared device buffers.

For each chunk, every cache layer (base layers, then MTP layers) runs the design's loop::

    ticket = gates.acquire(layer)        # the slot's previous occupant saved, read and computed
    load the cached prefix into the slot # only what the slot does not already hold
    project, write rows, select, attend  # compute
    save the chunk's blocks to the pool  # background thread; settles the ticket's save
    announce the layer to its readers    # remote decode endpoints (P/D); none in one process

A loader thread acquires slots and loads prefixes up to ``prefetch_layers`` layers ahead of the
compute (``kvoffload_engine.prefill_loader``), and a saver thread writes finished layers to the host
pool, so transfers overlap compute (torch ops release the GIL). Every request computes on the
engine's one compute thread, whichever thread calls ``compute`` (torch keeps kernels per thread).
``compute`` returns once every layer is computed and ``settle`` waits for the last saves without the
engine's lock, so the next request computes meanwhile. Which pool object holds each block
(the prefix cache, request-scoped tails) is ``kvoffload_engine.prefill_blocks``'s. Every failure
settles the tickets it leaves behind, so no slot stays held (I4, I6).

A cached prefix whose objects turn out unreachable (``ObjectUnreachable``: listed by a distributed
store, but their owner is gone; the backend removed them) is a prefix-cache miss, not a failed
request: while no layer has been announced to a reader yet, the request runs once more and
computes those blocks (``prefill_prefix_unreachable`` in the log). After an announcement the
decode may hold rows of the first try, so the error stands (I5).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog
import torch

from dsamodel.model import DSAModel
from dsamodel.served import ServedLayer, ServedModel, index_keys
from kvcore.device import DeviceAllocator
from kvcore.gates import GateSet
from kvcore.plan import BufferPlan
from kvcore.pool.block_keys import block_keys, is_request_key
from kvcore.pool.host_pool import HostPoolBackend, ObjectUnreachable
from kvcore.slottickets import SlotTicket
from kvoffload_engine.buffers import LayerBuffers
from kvoffload_engine.chunk_attention import attend
from kvoffload_engine.prefill_blocks import Chunk, PromptBlocks
from kvoffload_engine.prefill_loader import SlotLoader, fail_ticket
from kvoffload_engine.prefill_result import ComputedPrefill, PrefillError, PrefillResult

if TYPE_CHECKING:
    from kvoffload_engine.tp_prefill import Followers

log = structlog.get_logger(__name__)

# announce(ticket, request, start, end): rows [start, end) of ticket.layer are in the slot for its readers
Announce = Callable[[SlotTicket, "PrefillRequest", int, int], None]


@dataclass
class PrefillRequest:
    """One prompt to prefill. ``readers`` are the remote endpoints that read every layer."""

    request_id: str
    prompt: torch.Tensor  # [P] int64
    readers: frozenset[Hashable] = frozenset()
    sample: Callable[[torch.Tensor], int] | None = None  # first token from [V] logits; greedy if None
    # why the request should stop ("" to go on); asked before each layer, e.g. its reader went away
    cancelled: Callable[[], str] | None = None


class LayerwisePrefill:
    """The prefill engine of one process: a model, a buffer plan, a host pool, gates and threads."""

    def __init__(
        self,
        model: ServedModel,
        plan: BufferPlan,
        pool: HostPoolBackend,
        *,
        max_model_len: int,
        chunk_size: int,
        prefetch_layers: int,
        model_id: str,
        allocator: DeviceAllocator | None = None,
        gate_timeout_s: float = 60.0,
        lease_ttl_ms: int = 600_000,
        announce: Announce | None = None,
        buffer_segment: str | None = None,
        followers: Followers | None = None,
    ) -> None:
        layout = plan.layout
        if layout.num_layers != len(model.cache_layers):
            raise ValueError(f"plan has {layout.num_layers} layers, the model {len(model.cache_layers)}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if model.config.num_nextn_predict_layers > 1:
            raise ValueError(
                f"the reference engine runs at most one MTP layer; the model has "
                f"{model.config.num_nextn_predict_layers} (num_nextn_predict_layers)"
            )
        if prefetch_layers < 1:
            raise ValueError(f"prefetch_layers must be >= 1, got {prefetch_layers}")
        self.model, self.plan, self.pool = model, plan, pool
        self.block_size = layout.block_size
        self.chunk_size = chunk_size
        self.prefetch_layers = prefetch_layers
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.lease_ttl_ms = lease_ttl_ms
        self.allocator = allocator or DeviceAllocator(model.device)
        self.buffers = LayerBuffers(
            plan, -(-max_model_len // self.block_size), self.allocator, model.dtype, segment_name=buffer_segment
        )
        self.gates = GateSet(plan.layer_to_slot, default_timeout_s=gate_timeout_s)
        self.announce = announce
        self.followers = followers  # TP ranks 1..N-1 (kvoffload_engine.tp_prefill); None: one rank
        # (main plane, indexer plane or None) per layer; like decode, a pool without a layer's main plane is refused
        self._planes = [
            (pool.geometry.plane_index(i, "main"), self._plane(i, "indexer")) for i in range(layout.num_layers)
        ]
        # every request computes on this one thread, whoever calls: torch's CPU GEMM (oneDNN) keeps a
        # cache of up to 1024 kernels per calling thread, one per matmul shape (prompt length), so a
        # service computing on each request's own thread grew ~0.65 MB per shape and thread, unbounded
        self._computer = ThreadPoolExecutor(1, thread_name_prefix="kv-compute")
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kv-save")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-load")
        # (hash keys, done once saved) of computed requests whose saves may still run
        self._saving: list[tuple[frozenset[bytes], Future]] = []
        self._lock = threading.Lock()  # one request at a time through the buffers
        self._announced = False  # this try of the running request told a reader of a layer
        self._try = 0  # which try of the running request: the slot gates' owner is (request id, try)

    def _plane(self, layer: int, kind: str) -> int | None:  # None: the pool has no such plane
        try:
            return self.pool.geometry.plane_index(layer, kind)
        except ValueError:
            return None

    # ---- the request ------------------------------------------------------------------------

    def run(self, req: PrefillRequest) -> PrefillResult:
        """Prefill ``req.prompt``: ``compute`` it, then ``settle`` its saves."""
        return self.compute(req).settle()

    def compute(self, req: PrefillRequest) -> ComputedPrefill:
        """Compute every layer of ``req.prompt``, one request at a time; returns while the last saves
        may still run, so the next request can compute meanwhile (the slot gates keep its layers off a
        slot until that slot's save ends, I4)."""
        prompt = req.prompt
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(f"prompt must be a non-empty [P] tensor, got shape {list(prompt.shape)}")
        if prompt.numel() > self.max_model_len:
            raise ValueError(f"prompt of {prompt.numel()} tokens exceeds max_model_len={self.max_model_len}")
        return self._computer.submit(contextvars.copy_context().run, self._compute_tries, req).result()

    def _compute_tries(self, req: PrefillRequest) -> ComputedPrefill:
        """``compute`` on the engine's compute thread: a second try when the cached prefix was unreachable."""
        with self._lock:
            if self.followers is not None:
                self.followers.check()
            self._announced, self._try = False, 0
            try:
                return self._compute(req)
            except ObjectUnreachable as exc:
                if self._announced:
                    raise
                log.warning(
                    "prefill_prefix_unreachable",
                    request_id=req.request_id,
                    error=str(exc),
                    action="computing the prefix again",
                )
            # the backend removed them: the prefix match now stops before them. Another owner for the
            # gates, so the first try's failed slots are not reported to this one
            self._try = 1
            return self._compute(req)

    def _compute(self, req: PrefillRequest) -> ComputedPrefill:
        bs, n = self.block_size, req.prompt.numel()
        hash_keys = block_keys(self.model_id, req.prompt, bs)
        self._await_saves_of(hash_keys)
        self._save_errors: list[BaseException] = []  # this request's: each save is given the list
        blocks = PromptBlocks(self.pool, req.request_id, hash_keys, n, bs, self.lease_ttl_ms)
        logits = first = draft = None
        try:
            start = blocks.cached_blocks * bs
            for s in range(start, n, self.chunk_size):
                e = min(s + self.chunk_size, n)
                chunk = blocks.plan_chunk(s, e)
                chunk.first = s == start
                logits, first, draft = self._run_chunk(req, chunk, final=e == n)
            # the prefix match leaves at least one token to compute, so a last (final) chunk ran
            assert logits is not None and first is not None
        except BaseException:
            blocks.release_leases()
            self._saver.submit(lambda: None).result()
            blocks.remove_unwritten()  # complete hash blocks stay cached
            raise
        saved = self._saver.submit(lambda: None)  # done once this request's saves are
        self._saving.append((frozenset(k for k in blocks.keys if not is_request_key(k)), saved))
        return ComputedPrefill(req.request_id, blocks, saved, self._save_errors, logits, first, draft, start)

    def _await_saves_of(self, hash_keys: list[bytes]) -> None:
        """Wait for the saves of earlier requests that write blocks of this prompt, so that a prompt
        sharing a prefix with one still saving finds that prefix cached (``exists`` is true only for
        complete objects); a prompt sharing nothing does not wait."""
        self._saving = [(keys, saved) for keys, saved in self._saving if not saved.done()]
        for keys, saved in self._saving:
            if not keys.isdisjoint(hash_keys):
                saved.result()

    def release(self, result: PrefillResult) -> None:
        """End the hand-off: release the lease and drop the request-scoped objects."""
        result.lease.release()
        self.pool.remove(result.owned_keys)

    # ---- one chunk --------------------------------------------------------------------------

    def _run_chunk(
        self, req: PrefillRequest, chunk: Chunk, *, final: bool
    ) -> tuple[torch.Tensor | None, int | None, torch.Tensor | None]:
        """Run the chunk through every layer; the final chunk also returns (logits, first token, draft logits)."""
        model = self.model
        s, e = chunk.start, chunk.end
        tokens = req.prompt[s:e].to(model.device)
        positions = torch.arange(s, e, device=model.device)
        layers = model.cache_layers
        pipeline = SlotLoader(
            self._loader,
            self.gates,
            self.buffers,
            self.plan.num_logical_layers,
            self.prefetch_layers,
            req.readers,
            (req.request_id, self._try),
            lambda ticket: self._load(ticket, req, chunk),
        )
        logits = first = draft = None
        followers = self.followers
        try:
            if followers is not None:
                followers.chunk(req.request_id, req.prompt[s : e + 1].tolist(), s, e, final)
            h = model.embed(tokens)  # [T, D]
            base = model.config.num_hidden_layers
            for layer in layers[:base]:
                h = self._layer(layer, pipeline.take(layer.cache_index), req, chunk, h, positions)
            if final:
                logits = model.logits(h[-1:])[0]  # [V]
                first = req.sample(logits) if req.sample else int(torch.argmax(logits))
                if followers is not None and len(layers) > base:
                    followers.first(first)  # their MTP layer's last input
            if len(layers) > base and isinstance(model, DSAModel):  # its MTP layer (a Llama model has none)
                nxt = req.prompt[s + 1 : e + 1].to(model.device)
                if nxt.numel() < e - s:
                    nxt = torch.cat((nxt, torch.tensor([first], device=model.device)))
                h_mtp = model.mtp_input(model.final_norm(h), nxt, depth=0)  # [T, D]
                layer = layers[base]
                h_mtp = self._layer(layer, pipeline.take(layer.cache_index), req, chunk, h_mtp, positions)
                if final:
                    draft = model.mtp_logits(h_mtp[-1:], depth=0)[0]  # [V]
        except BaseException as exc:
            if followers is not None:
                followers.abort(exc)
            pipeline.abort(exc)
            raise
        pipeline.finish()
        return logits, first, draft

    def _layer(self, layer: ServedLayer, ticket: SlotTicket, req, chunk: Chunk, h, positions):
        """Compute one layer of the chunk in its slot, then hand the slot to the saver."""
        i = layer.cache_index
        s, e = chunk.start, chunk.end
        main, idx = self.buffers.main(i), self.buffers.indexer(i)
        try:
            why = req.cancelled() if req.cancelled else ""
            if why:
                raise PrefillError(f"request {req.request_id} stopped before layer {i}: {why}")
            if self.followers is not None:
                self.followers.layer(main[:s], idx[:s])  # go on, with the rows [0, s) this slot holds
            proj = layer.project(h, positions)
            main[s:e] = proj.kv  # [T, R + r]
            idx[s:e] = self.model.index_codec.encode(index_keys(proj))  # [T, W]
            pad_end = chunk.end_block * self.block_size
            main[e:pad_end] = 0  # tail rows are saved too: make them deterministic
            idx[e:pad_end] = 0
            h = layer.finish(h, attend(self.model, layer, proj, main[:e], idx[:e], positions))  # [T, D]
            if self.followers is not None:
                self.followers.layer_done()
        except BaseException as exc:
            self.buffers.forget(i)
            fail_ticket(ticket, exc, compute=True, save=True, reads=True)
            raise
        ticket.computed()
        self.buffers.set_residency(i, req.request_id, e)
        self._saver.submit(self._save, ticket, chunk, i, self._save_errors)
        if self.announce is not None and ticket.readers:
            # the first computed chunk also carries the prefix loaded from the prefix cache
            self._announced = True  # from here a reader may hold this try's rows
            try:
                self.announce(ticket, req, 0 if chunk.first else s, e)
            except BaseException as exc:  # readers never told can never answer: fail them now
                ticket.fail_pending_reads(f"announcing layer {i} failed: {exc!r}")
                raise
        return h

    def _save(self, ticket: SlotTicket, chunk: Chunk, layer: int, errors: list[BaseException]) -> None:
        try:
            if chunk.save_keys:
                blocks = torch.tensor(chunk.save_blocks, dtype=torch.long)
                main_plane, idx_plane = self._planes[layer]
                srcs = {main_plane: self.buffers.blocks(self.buffers.main(layer))[blocks].cpu()}  # [n, bs, R + r]
                if idx_plane is not None:
                    srcs[idx_plane] = self.buffers.blocks(self.buffers.indexer(layer))[blocks].cpu()  # [n, bs, Di]
                self.pool.put_planes_from(chunk.save_keys, srcs)  # one round trip for both (remote pools)
        except BaseException as exc:  # noqa: BLE001 - the ticket carries it: the prefill raises it where it waits
            log.error("prefill_save_failed", layer=layer, error=str(exc))
            errors.append(exc)
            ticket.save_failed(exc)
            return
        ticket.saved()

    def _load(self, ticket: SlotTicket, req: PrefillRequest, chunk: Chunk) -> None:
        """Make the slot hold ``ticket.layer``'s rows [0, chunk.start) of the request."""
        layer = ticket.layer
        lo = self.buffers.load_from(layer, req.request_id, chunk.start)
        keys = chunk.load_keys[lo:]
        if keys:
            main_plane, idx_plane = self._planes[layer]
            hi = lo + len(keys)
            main = self.buffers.blocks(self.buffers.main(layer))
            dst = torch.empty((len(keys),) + tuple(main.shape[1:]), dtype=main.dtype)
            self.pool.get_into(keys, main_plane, dst)
            main[lo:hi] = dst.to(main.device)
            if idx_plane is not None:
                idx = self.buffers.blocks(self.buffers.indexer(layer))
                dst = torch.empty((len(keys),) + tuple(idx.shape[1:]), dtype=idx.dtype)
                self.pool.get_into(keys, idx_plane, dst)
                idx[lo:hi] = dst.to(idx.device)
        self.buffers.set_residency(layer, req.request_id, chunk.start)

    def close(self) -> None:
        self.gates.abort_all("prefill engine closed")
        self._computer.shutdown(wait=True)
        self._saver.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        self.buffers.close()
