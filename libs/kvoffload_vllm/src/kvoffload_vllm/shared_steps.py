"""The store connector's worker side on shared layer buffers: one step, layer by layer.

Before layer L writes the step's tokens into its buffer (``before_attention``: ``hook_layers``
wraps the layer's ``do_kv_cache_update``, which vLLM 0.32 runs before the connector's
``wait_for_layer_load``; every connector's ``save_kv_layer`` of the layers before L has run by then)
the forward waits until the step's loader (``kvoffload_vllm.shared_loader``: a thread, started at
the step's first layer, running up to ``layerwise_prefetch_layers`` layers ahead) has prepared L:
  1. the reuse gate (``kvoffload_vllm.reuse_gate``): wait until L's buffer's previous occupant is
     saved and pulled by every decode reading it (bounded; a stuck holder fails loudly);
  2. the step's prefix hits: blocks from the host pool into L's buffer (and into ``RequestKV``);
  3. for each request of the step, the blocks its earlier steps computed (earlier chunks, a partial
     block included): from ``RequestKV`` into L's buffer.
After L's attention (``after_attention``, from ``save_kv_layer``): L is held at the gate while the
saver thread copies the step's blocks of L into ``RequestKV``; the pool's saves of full prompt
blocks (the store's ordinary saves) queue before the release. Independent layers keep their own
buffer: only step 2 applies to them. The step's end (``end_step``, from ``wait_for_save``) does not
wait for the host copies: the next reload of a layer waits at the gate for it (one saver thread, in
order); their futures are checked once done.

A DSA layer's indexer cache (``SharedBuffers.caches``) goes with its layer: its buffer's indexer
descriptor is made ready with the latent one, ahead of the indexer's forward (which writes and reads
its keys before the attention's own write: a forward pre-hook on the attention's ``indexer``
module), loaded from its own pool plane, and saved with the layer; a layer's host-copy row holds its
caches' pages side by side.

A failed load marks the request's blocks as load errors (vLLM recomputes them); a gate past its
bound (on the loader) raises ``ReuseTimeout`` out of the forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from kvcore.config.errors import ConfigError
from kvcore.hotcache.gather import write_pages
from kvcore.pool.host_pool import HostPoolBackend
from kvoffload_vllm.block_bytes import block_bytes
from kvoffload_vllm.d2h_plan import blocks_of
from kvoffload_vllm.layout import CacheLayout
from kvoffload_vllm.plan import Transfer
from kvoffload_vllm.request_kv import RequestKV, RequestKVFull
from kvoffload_vllm.request_kv_budget import HostCopies
from kvoffload_vllm.reuse_gate import GATE, SAVE_BOUND_S
from kvoffload_vllm.shared_buffers import SharedBuffers
from kvoffload_vllm.shared_loader import LayerLoader
from kvoffload_vllm.stats import Counters

log = structlog.get_logger("vllm.kvoffload.store")


@dataclass(frozen=True)
class StepBlocks:
    """One request of a step on a shared-buffer node: all its vLLM blocks so far, tokens computed
    before the step and scheduled in it, and the most blocks it was admitted with (its host copy's
    ceiling, ``kvoffload_vllm.request_kv_budget``)."""

    request_id: str
    block_ids: tuple[int, ...]
    computed: int
    scheduled: int
    max_blocks: int | None = None

    def positions(self, block_size: int) -> tuple[range, range]:
        """(blocks to reload before attention, blocks the step writes), within the request's blocks."""
        n = len(self.block_ids)
        before = blocks_of(0, self.computed, block_size)
        written = blocks_of(self.computed, self.computed + self.scheduled, block_size)
        return range(0, min(before.stop, n)), range(written.start, min(written.stop, n))


@dataclass
class _Step:
    loads: list[Transfer]
    requests: list[StepBlocks]
    meta: Any = None  # the StoreStepMetadata it was begun from
    prepared: set[str] = field(default_factory=set)  # layers whose buffer is ready this step
    failed: set[str] = field(default_factory=set)
    hit_layers: int = 0  # layers whose prefix hits were loaded
    gate_wait_s: float = 0.0
    reloaded_blocks: int = 0
    loader: LayerLoader | None = None


class SharedSteps:
    def __init__(
        self,
        shared: SharedBuffers,
        layout: CacheLayout,
        caches: dict[str, torch.Tensor],
        saver: Executor,
        on_load_error: Callable[[list[int]], None],
        metadata: Callable[[], Any],
        counters: Counters,
        planes: Sequence[str] = (),
        depth: int = 1,
    ) -> None:
        """``layout``: the attention layers' caches; ``caches``: every cache (a DSA layer's indexer one
        too); ``planes``: the pool's planes, the group's caches in order (default the layout's layers);
        ``depth``: how many layers ahead of the forward the loader runs (``layerwise_prefetch_layers``)."""
        self.depth = depth
        self._host_saves: list[Future] = []  # host copies not yet seen done
        self.shared, self.layout, self._saver, self._on_load_error = shared, layout, saver, on_load_error
        self._metadata = metadata  # the step's bound StoreStepMetadata, None outside a step
        self._counters = counters  # the store's: blocks_loaded and bytes_loaded count the hits loaded here
        self._bytes = {n: block_bytes(t, n) for n, t in caches.items()}
        self._planes = {n: i for i, n in enumerate(planes or layout.layer_names)}
        self._cols: dict[str, slice] = {}  # cache -> its columns in its layer's host-copy row
        for layer in layout.layer_names:
            at = 0
            for cache in shared.caches(layer):
                self._cols[cache] = slice(at, at + self._bytes[cache].shape[1])
                at += self._bytes[cache].shape[1]
        row = max(c.stop for c in self._cols.values())
        device = next(iter(caches.values())).device
        pin = device.type != "cpu"
        self._on_cuda = device.type == "cuda"
        self.request_kv = RequestKV([n for n in layout.layer_names if shared.is_shared(n)], row, pin=pin)
        self._step = _Step([], [])

    # ---- the forward thread ------------------------------------------------------------------

    def hook_layers(self, forward_context: dict[str, Any], pool: Callable[[], HostPoolBackend | None]) -> None:
        """Run ``before_attention`` ahead of each layer's KV cache write (the write precedes vLLM's
        ``wait_for_layer_load`` for backends with a separate ``do_kv_cache_update``)."""
        for name in self.layout.layer_names:
            impl = getattr(forward_context.get(name), "impl", None)
            write = getattr(impl, "do_kv_cache_update", None)
            if impl is None or write is None:  # the backend writes inside its forward, after wait_for_layer_load
                continue

            def update(*args: Any, _name: str = name, _write: Callable[..., Any] = write, **kwargs: Any) -> Any:
                self.before_attention(_name, pool())
                return _write(*args, **kwargs)

            impl.do_kv_cache_update = update
        for name in self.layout.layer_names:
            if len(self.shared.caches(name)) > 1:
                self._hook_indexer(forward_context, name, pool)

    def _hook_indexer(
        self, forward_context: dict[str, Any], name: str, pool: Callable[[], HostPoolBackend | None]
    ) -> None:
        """``before_attention`` ahead of the indexer's forward: it writes and reads the layer's indexer
        cache before the attention writes; ConfigError where no indexer module runs it."""
        module = getattr(forward_context.get(name), "indexer", None)
        if not isinstance(module, torch.nn.Module):
            raise ConfigError(
                [
                    f"layerwise_num_shared_buffers: layer {name!r} has an indexer cache "
                    f"({self.shared.caches(name)[1]!r}) but no indexer module to reload it before: its "
                    "indexer would read the keys of the buffer's previous layer"
                ]
            )
        module.register_forward_pre_hook(lambda _module, _args: self.before_attention(name, pool()))

    def _current(self, pool: HostPoolBackend | None) -> _Step | None:
        """This step (begun at its first layer: vLLM may call ``start_load_kv`` after the forward, and
        its loader started), None outside a step (vLLM's dummy and profiling runs)."""
        meta = self._metadata()
        if meta is None:
            return None
        if self._step.meta is not meta:
            self._close_loader()  # a step that did not reach its end (never in vLLM's own order)
            step = self._step = _Step(list(meta.loads), list(meta.steps), meta=meta)
            self._reserve(step, meta.host_copies)
            stream = torch.cuda.current_stream() if self._on_cuda else None
            prepare = functools.partial(self._run_prepare, step, pool)
            step.loader = LayerLoader(
                self.layout.layer_names, self.shared.previous_occupant, self.depth, prepare, stream
            ).start()
        return self._step

    def _run_prepare(self, step: _Step, pool: HostPoolBackend | None, layer: str) -> None:
        self._prepare(step, layer, pool)  # looked up at each call (the tests observe it)

    def _close_loader(self) -> None:
        if self._step.loader is not None:
            self._step.loader.close()

    def _reserve(self, step: _Step, host: HostCopies | None) -> None:
        """The copies of requests vLLM finished are dropped first (the scheduler gave their room to
        this step), then each request gets room for its blocks. A reserve past the budget (the
        scheduler admits only what fits: a bug) fails the request's loads, never the host."""
        if host is not None:
            self.request_kv.drop(host.finished)
            self.request_kv.budget_bytes = host.budget_bytes
        for r in step.requests:
            try:
                self.request_kv.reserve(r.request_id, len(r.block_ids), r.max_blocks)
            except RequestKVFull as exc:
                self._fail(step, [r.request_id], "(host copy)", exc)

    def before_attention(self, layer: str, pool: HostPoolBackend | None) -> None:
        """Until the loader prepared ``layer`` (its exception raised here); idempotent within a step
        (vLLM's ``wait_for_layer_load`` follows the hooked write)."""
        step = self._current(pool)
        if step is None:
            return
        if step.loader is not None and layer in step.loader.index:
            step.loader.wait(layer)
        else:  # not a layer of the layout: prepared here, as the loader would
            self._prepare(step, layer, pool)

    def _prepare(self, step: _Step, layer: str, pool: HostPoolBackend | None) -> None:
        """The gate, the prefix hits, the earlier chunks: ``layer``'s buffer made ready for the step."""
        shared = self.shared.is_shared(layer)
        if layer in step.prepared:
            return
        step.prepared.add(layer)
        if shared:
            step.gate_wait_s += GATE.wait_free(self.shared.previous_occupant[layer], waiter=layer)
        hit: dict[str, int] = {}
        if step.loads and pool is not None:
            hit = self._load_hits(step, layer, pool, shared)
        if shared:
            self._reload(step, layer, hit)

    def _load_hits(self, step: _Step, layer: str, pool: HostPoolBackend, shared: bool) -> dict[str, int]:
        """The pool's blocks of the step's prefix hits into ``layer``'s buffer; request -> blocks."""
        loads = [t for t in step.loads if t.request_id not in step.failed]
        keys = [k for t in loads for k in t.keys]
        if not keys:
            return {}
        try:
            staging = self._read_hits(pool, keys, layer)
            ids = torch.tensor([b for t in loads for b in t.block_ids], dtype=torch.long)
            for cache in self.shared.caches(layer):
                write_pages(self._bytes[cache], ids, staging[:, self._cols[cache]])
            at = 0
            for t in loads:
                if shared:
                    positions = range(t.start, t.start + len(t.keys))
                    self.request_kv.put(t.request_id, layer, positions, staging[at : at + len(t.keys)])
                at += len(t.keys)
        except Exception as exc:  # noqa: BLE001 - reported to vLLM as load errors: it recomputes the blocks
            self._fail(step, [t.request_id for t in loads], layer, exc)
            return {}
        step.hit_layers += 1
        self._counters.add(bytes_loaded=len(keys) * sum(self._bytes[c].shape[1] for c in self.shared.caches(layer)))
        return {t.request_id: t.start + len(t.keys) for t in loads}

    def _read_hits(self, pool: HostPoolBackend, keys: list[bytes], layer: str) -> torch.Tensor:
        """The blocks ``keys`` of every cache of ``layer`` from the pool, as host-copy rows ``[n, row]``."""
        rows = torch.empty((len(keys), self.request_kv.block_bytes), dtype=torch.uint8)
        for cache in self.shared.caches(layer):
            cols = self._cols[cache]
            part = rows if cols.stop - cols.start == rows.shape[1] else torch.empty_like(rows[:, cols])
            pool.get_into(keys, self._planes[cache], part.view(len(keys), 1, -1))  # one row: the page
            if part is not rows:
                rows[:, cols] = part
        return rows

    def _reload(self, step: _Step, layer: str, hit: dict[str, int]) -> None:
        """Blocks earlier steps computed, from ``RequestKV`` into ``layer``'s buffer."""
        dst, bs = self._bytes[layer], self.layout.block_size
        caches = self.shared.caches(layer)
        for r in step.requests:
            if r.request_id in step.failed:
                continue
            again, _ = r.positions(bs)
            again = range(max(again.start, hit.get(r.request_id, 0)), again.stop)
            if not again:
                continue
            try:
                ids = torch.tensor(r.block_ids[again.start : again.stop], dtype=torch.long, device=dst.device)
                rows = self.request_kv.get(r.request_id, layer, again)
                for cache in caches:
                    write_pages(self._bytes[cache], ids, rows[:, self._cols[cache]])
                step.reloaded_blocks += len(again)
            except Exception as exc:  # noqa: BLE001 - reported to vLLM as load errors: it recomputes the blocks
                self._fail(step, [r.request_id], layer, exc)

    def _fail(self, step: _Step, request_ids: list[str], layer: str, exc: BaseException) -> None:
        step.failed.update(request_ids)
        blocks = [b for r in step.requests if r.request_id in request_ids for b in r.block_ids]
        blocks += [b for t in step.loads if t.request_id in request_ids for b in t.block_ids]
        self._on_load_error(sorted(set(blocks)))
        log.error("kvoffload_shared_load_failed", request_ids=request_ids, layer=layer, error=str(exc))

    def after_attention(self, layer: str) -> list[Future]:
        """Copy the step's blocks of ``layer`` to ``RequestKV`` (queued behind the pool's saves of the
        layer: one saver thread), holding the layer at the gate until it is done."""
        if not self.shared.is_shared(layer) or not self._step.requests:
            return []
        GATE.hold(layer, "save", SAVE_BOUND_S)
        future = self._saver.submit(self._save, layer, list(self._step.requests))
        self._host_saves.append(future)
        return [future]

    def _save(self, layer: str, requests: list[StepBlocks]) -> None:
        """A request whose copy failed loses it: its next reload fails and vLLM recomputes."""
        try:
            with torch.inference_mode():  # the host copies were made in the forward's inference mode
                for r in requests:
                    self._save_one(layer, r)
        finally:
            GATE.release(layer, "save")

    def _save_one(self, layer: str, r: StepBlocks) -> None:
        src = self._bytes[layer]
        _, written = r.positions(self.layout.block_size)
        if not written:
            return
        try:
            ids = torch.tensor(r.block_ids[written.start : written.stop], dtype=torch.long, device=src.device)
            self.request_kv.put(r.request_id, layer, written, self._host_rows(layer, ids))
        except Exception as exc:  # noqa: BLE001 - the request's host copy is dropped: never reloaded stale
            self.request_kv.drop([r.request_id])
            log.error("kvoffload_shared_save_failed", request_id=r.request_id, layer=layer, error=str(exc))

    def _host_rows(self, layer: str, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` of every cache of ``layer`` as host-copy rows (its caches side by side)."""
        if self._cols[layer].stop == self.request_kv.block_bytes:  # one cache fills the row
            return self._bytes[layer].index_select(0, ids)
        rows = torch.empty((len(ids), self.request_kv.block_bytes), dtype=torch.uint8, device=ids.device)
        for cache in self.shared.caches(layer):
            rows[:, self._cols[cache]] = self._bytes[cache].index_select(0, ids)
        return rows

    def end_step(self) -> None:
        """The step's loader joined (it prepared every layer the forward waited for); the host copies
        not waited for (the gate orders the next reload after them): those done are checked."""
        self._close_loader()
        pending = []
        for fut in self._host_saves:
            if fut.done():
                fut.result()  # _save reports its own failures; this raises only on a bug
            else:
                pending.append(fut)
        self._host_saves = pending
        step = self._step
        if step.hit_layers == len(self.layout.layer_names):  # every layer of the hits loaded
            loaded = [t for t in step.loads if t.request_id not in step.failed]
            self._counters.add(blocks_loaded=sum(len(t.keys) for t in loaded))
            for t in loaded:
                log.info("kvoffload_loaded", request_id=t.request_id, blocks=len(t.keys), layerwise=True)
        if step.requests:
            log.info(
                "kvoffload_shared_step",
                request_ids=[r.request_id for r in step.requests],
                layers_prepared=len(step.prepared),
                reloaded_blocks=step.reloaded_blocks,
                gate_wait_s=round(step.gate_wait_s, 4),
                host_copy_bytes=self.request_kv.nbytes(),
            )
        self._step = _Step([], [])

    def finished(self, request_ids: set[str]) -> None:
        self.request_kv.drop(request_ids)
