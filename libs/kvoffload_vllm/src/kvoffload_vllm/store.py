"""``AscendStoreConnector`` for vLLM: the layerwise host KV pool and cross-instance prefix cache.

The seed's ``AscendStoreConnector`` semantics on vLLM's ``KVConnectorBase_V1``, with the kvoffload host pool
(``backend: "kvoffload"``: segments indexed by ``kvoffload-metastore``; ``"mooncake"``: on Mooncake Store)::

    --kv-transfer-config '{"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "kvoffload_vllm",
        "kv_connector_extra_config": {"backend": "kvoffload", "use_layerwise": true,
                                      "metastore": "127.0.0.1:5000", "host_pool_gb": 1}}'

Scheduler side (engine core process)
    ``get_num_new_matched_tokens``  per KV cache group one ``exists`` of the backend's index over the prompt's
                                    block keys beyond the local prefix-cache hit: the leading run
                                    of complete blocks every group holds is the external hit
                                    (loaded synchronously, before the forward). The index (metastore,
                                    mooncake_master) down: a warning and no hit, never a failure. With shared
                                    buffers, None (vLLM asks again later) while the request's host
                                    copy has no room (``request_kv_budget``).
    ``update_state_after_alloc``    remembers the promised tokens; ``build_connector_meta``: this
                                    step's loads and saves (``kvoffload_vllm.plan``).
    ``request_finished_all_groups`` forgets the request; its blocks are freed at once (saves end with their step).

Worker side (model runner process), hook by hook
    ``register_kv_caches``          each group's caches as byte views (``group_caches``); a pool
                                    per group, on its backend (``group_pools``, ``host_pool_gb``).
    ``start_load_kv``               a loader thread copies each layer's hit blocks from the pool (any
                                    pool on this host) into the request's vLLM blocks, layer 0 first;
                                    ``wait_for_layer_load(layer)`` waits for that layer. A failed load's
                                    blocks are load errors (``get_block_ids_with_load_errors``): recomputed.
    ``save_kv_layer``               at the step's first layer, allocates pool objects for the blocks
                                    this step completes (those in the pool or being written by
                                    another engine skipped); then each layer's blocks go to a
                                    saver thread as the forward goes on.
    ``wait_for_save``               the barrier: every layer written or the failed objects removed (an
                                    object is visible to lookups once all its layers are written).
    ``get_finished``                frees finished requests' host copies (shared buffers).
A kv_producer with ``layerwise_num_shared_buffers`` keeps a few shared layer buffers (``kv_cache_patch``):
its loads and host copies run layer by layer in ``shared_steps``. ``SupportsHMA``: each KV cache group by
its own block table and block size (``kv_groups``); vLLM's null block (a sliding window's dropped blocks)
is never saved or loaded into. Tensor parallel: each rank runs the step under its own keys
(``store_tp``). Counters go to structlog lines (request id) and vLLM's stats.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvcore.config.names import STORE_CONNECTOR
from kvcore.pool.host_pool import HostPoolBackend, PoolError
from kvoffload_vllm.group_caches import GroupCaches
from kvoffload_vllm.group_pools import load_groups, open_group_pools
from kvoffload_vllm.kv_groups import hit_unit, kv_groups
from kvoffload_vllm.layout import CacheLayout, group_model_ids
from kvoffload_vllm.plan import StorePlanner, Transfer, scheduled_requests
from kvoffload_vllm.pool_alloc import allocate
from kvoffload_vllm.request_kv_budget import HostCopies, admission_of
from kvoffload_vllm.shared_buffers import check_caches, group_plan, requested
from kvoffload_vllm.shared_steps import SharedSteps, StepBlocks
from kvoffload_vllm.stats import Counters, CountingConnector
from kvoffload_vllm.store_config import store_config
from kvoffload_vllm.store_counters import COUNTERS
from kvoffload_vllm.store_lookup import open_lookup
from kvoffload_vllm.store_saves import report_save, report_step
from kvoffload_vllm.store_tp import RankKeys
from kvoffload_vllm.tp import kv_replicated, tp_rank_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = structlog.get_logger("vllm.kvoffload.store")

DEFAULT_HOST_POOL_GB = 1.0
METASTORE_TIMEOUT_S = 5.0


@dataclass
class StoreStepMetadata(KVConnectorMetadata):
    """One scheduler step's work for the workers."""

    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    steps: list[StepBlocks] = field(default_factory=list)  # shared layer buffers only: every request
    host_copies: HostCopies | None = None  # shared layer buffers only: the copies' budget, finished requests


class AscendStoreConnector(CountingConnector, KVConnectorBase_V1, SupportsHMA):
    """See the module docstring; one instance per role (scheduler / worker)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._store = store_config(vllm_config)
        self._groups = kv_groups(kv_cache_config.kv_cache_groups, STORE_CONNECTOR)
        self._layer_order = [n for g in self._groups for n in g.layer_names]
        self._group_ids = group_model_ids(vllm_config, self._groups)
        self.model_id = ",".join(self._group_ids)  # one group: its id
        self._shared = group_plan(requested(vllm_config.kv_transfer_config.kv_role, self._store), self._groups)  # type: ignore[union-attr]  # store_config required it
        self._counters = Counters(COUNTERS)
        self._lock = threading.Lock()
        tp = vllm_config.parallel_config.tensor_parallel_size
        self._ranks = RankKeys(tp_rank_of(vllm_config), tp, kv_replicated(vllm_config))
        if role == KVConnectorRole.SCHEDULER:
            self._client = open_lookup(self._store, METASTORE_TIMEOUT_S)  # the backend's index (store_lookup)
            self._planners = [
                StorePlanner(mid, g.block_size, g.index) for mid, g in zip(self._group_ids, self._groups, strict=True)
            ]
            self._hit_unit = hit_unit(self._groups)
            self._admission = admission_of(vllm_config, self._store, self._shared, self._groups)  # checked here
        else:
            self._pools: list[HostPoolBackend] = []  # one per KV cache group, by register_kv_caches
            self._layout: CacheLayout  # shared layer buffers only (one group), by register_kv_caches
            self._group_caches: list[GroupCaches] = []  # set by register_kv_caches, before any load or save
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-save")
            self._step_saves: list[Transfer] | None = None  # allocated at the step's first save_kv_layer
            self._save_futures: list[tuple[Transfer, Future]] = []
            self._handoffs: list[float] = []  # this step: when each layer's save was handed off ...
            self._saved_at: dict[tuple[int, int], float] = {}  # ... and when each (group, layer)'s saves finished
            self._layer_loaded: dict[str, threading.Event] = {}
            self._loader: threading.Thread | None = None
            self._load_errors: set[int] = set()
            self._shared_steps: SharedSteps | None = None  # register_kv_caches, with shared buffers
        log.info(
            "kvoffload_store_connector",
            role=role.name,
            model_id=self.model_id,
            metastore=self._store.metastore,
            block_sizes=[g.block_size for g in self._groups],
            shared_buffers=None if self._shared is None else [list(s) for s in self._shared.plan.slots],
        )

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prompt = request.prompt_token_ids
        if not prompt:
            return 0, False
        if self._admission is not None and not self._admission.admit(request):
            return None, False  # no room for its host copy yet: vLLM asks again at a later step
        try:  # every group's blocks of a hit present, each group's whole
            exists = self._ranks.exists(self._client.exists)  # every TP rank's blocks present
            hit = min(p.lookup(request.request_id, prompt, num_computed_tokens, exists) for p in self._planners)
            hit -= hit % self._hit_unit
        except PoolError as exc:  # the index is down or refuses: serve without the pool's prefix cache
            log.warning("kvoffload_lookup_failed", request_id=request.request_id, error=str(exc))
            return 0, False
        self._counters.add(lookups=1, hit_tokens=hit)
        if hit:
            log.info(
                "kvoffload_prefix_hit",
                request_id=request.request_id,
                hit_tokens=hit,
                local_tokens=num_computed_tokens,
                prompt_tokens=len(prompt),
            )
        return hit, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        for planner in self._planners:
            planner.allocated(request.request_id, num_external_tokens)
        if self._admission is not None and request.prompt_token_ids:
            self._admission.hold(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = StoreStepMetadata()
        for s in scheduled_requests(scheduler_output):
            if s.first and not s.prompt:
                continue
            for planner in self._planners:  # each group by its own block table
                # a new request comes with all its blocks (None is a running request's "no new block")
                ids = s.block_ids[planner.group] if s.block_ids else None
                if s.first:
                    load, save = planner.new_request(s.req_id, s.prompt or [], ids or [], s.computed, s.scheduled)
                    meta.loads += [load] if load else []
                else:
                    save = planner.running_request(s.req_id, ids, s.resumed, s.computed, s.scheduled)
                meta.saves += [save] if save else []
            blocks = self._planners[0].block_ids(s.req_id) if self._shared is not None else None
            if blocks is not None and self._admission is not None:
                ceiling = self._admission.max_blocks(s.req_id)
                meta.steps.append(StepBlocks(s.req_id, blocks, s.computed, s.scheduled, ceiling))
        meta.host_copies = None if self._admission is None else self._admission.take_step()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        for planner in self._planners:
            planner.finished(request.request_id)
        if self._admission is not None:
            self._admission.release(request.request_id)
        return False, None  # saves end with the step that computed them: the blocks are free at once

    # ---- worker side -------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The step as this TP rank runs it: its loads and saves under its own keys (``store_tp``)."""
        if isinstance(connector_metadata, StoreStepMetadata) and self._ranks.size > 1:
            loads, saves = self._ranks.mine(connector_metadata.loads, connector_metadata.saves)
            connector_metadata = dataclasses.replace(connector_metadata, loads=loads, saves=saves)
        super().bind_connector_metadata(connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks
        self._group_caches = [GroupCaches.of(g, kv_caches, num_blocks) for g in self._groups]
        if self._shared is not None:
            self._start_shared_steps(kv_caches)
        pool_gb = self._store.host_pool_gb or DEFAULT_HOST_POOL_GB
        self._pools = open_group_pools(self._store, self._group_caches, pool_gb, METASTORE_TIMEOUT_S)

    def _start_shared_steps(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Shared layer buffers (one KV cache group): loads and host copies layer by layer. The layout is
        the attention layers' caches; a DSA layer's indexer cache goes with its layer."""
        assert self._shared is not None
        group = self._groups[0]
        layers = [n for n in group.layer_names if n in self._shared.layer_names]
        self._layout = CacheLayout.of(
            {n: kv_caches[n] for n in layers if n in kv_caches},
            layers,
            self._kv_cache_config.num_blocks,
            group.block_size,
            group.specs[group.layer_names.index(layers[0])].page_size_bytes,
        )
        caches = {name: kv_caches[name] for name in group.layer_names}
        check_caches(self._shared, caches)
        self._shared_steps = SharedSteps(
            self._shared,
            self._layout,
            caches,
            self._saver,
            self._load_failed,
            lambda: self._get_connector_metadata() if self.has_connector_metadata() else None,
            self._counters,
            planes=group.layer_names,
            depth=self._store.layerwise_prefetch_layers or min(self._store.layerwise_num_shared_buffers or 1, 8),
        )
        self._shared_steps.hook_layers(
            self._vllm_config.compilation_config.static_forward_context,
            lambda: self._pools[0] if self._pools else None,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreStepMetadata)
        if self._shared_steps is not None:  # loads happen layer by layer, behind the reuse gate
            return
        if not meta.loads or not self._pools:
            return
        self._layer_loaded = {name: threading.Event() for name in self._layer_order}
        self._loader = threading.Thread(target=self._load, args=(list(meta.loads),), name="kvoffload-load", daemon=True)
        self._loader.start()

    def _load(self, loads: list[Transfer]) -> None:
        """Group by group, layer by layer: every load's blocks from the pool into its vLLM blocks; on a
        failure the blocks of every load of the step become load errors and the remaining layers are released."""
        pending, t0 = list(self._layer_order), time.perf_counter()

        def layer_done(name: str) -> None:
            pending.remove(name)
            self._layer_loaded[name].set()

        try:
            blocks, nbytes = load_groups(loads, self._group_caches, self._pools, layer_done)
            self._counters.add(blocks_loaded=blocks, bytes_loaded=nbytes)
            for t in loads:
                log.info(
                    "kvoffload_loaded",
                    request_id=t.request_id,
                    group=t.group,
                    blocks=len(t.keys),
                    seconds=round(time.perf_counter() - t0, 4),
                )
        except Exception as exc:  # noqa: BLE001 - reported to vLLM as load errors: it recomputes the blocks
            self._load_failed([b for t in loads for b in t.block_ids])
            log.error(
                "kvoffload_load_failed",
                request_ids=sorted({t.request_id for t in loads}),
                error=str(exc),
                layers_left=len(pending),
            )
        finally:
            for name in pending:
                self._layer_loaded[name].set()

    def _load_failed(self, blocks: list[int]) -> None:
        """``blocks`` go to vLLM as load errors (``get_block_ids_with_load_errors``): it recomputes them."""
        with self._lock:
            self._load_errors.update(blocks)
        self._counters.add(load_errors=len(blocks))

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._shared_steps is not None:
            self._shared_steps.before_attention(layer_name, self._pools[0] if self._pools else None)
            return
        event = self._layer_loaded.get(layer_name)
        if event is not None:
            event.wait()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreStepMetadata)
        if meta.saves and self._pools:
            if self._step_saves is None:
                self._step_saves = self._allocate(meta.saves)
            if self._step_saves:
                self._handoffs.append(time.perf_counter())
                for t in self._step_saves:
                    c = self._group_caches[t.group]
                    for cache in self._shared.caches(layer_name) if self._shared else (layer_name,):
                        if cache in c.group.layer_names:  # a DSA layer's indexer cache with it (shared buffers)
                            plane = c.group.layer_names.index(cache)
                            self._save_futures.append((t, self._saver.submit(self._save, t, plane)))
        if self._shared_steps is not None:  # after the pool's saves of the layer: one saver thread, in order
            self._shared_steps.after_attention(layer_name)

    def _allocate(self, saves: list[Transfer]) -> list[Transfer]:
        out, skipped = allocate(self._pools, saves)
        for t, exc in skipped:  # a full pool or a MetaStore outage: the blocks are simply not cached
            self._counters.add(save_errors=len(t.keys))
            log.warning(
                "kvoffload_save_skipped", request_id=t.request_id, group=t.group, blocks=len(t.keys), error=str(exc)
            )
        return out

    def _save(self, t: Transfer, plane: int) -> None:
        c = self._group_caches[t.group]
        self._pools[t.group].put_from(list(t.keys), plane, c.read(plane, torch.tensor(t.block_ids, dtype=torch.long)))
        self._saved_at[(t.group, plane)] = time.perf_counter()  # one saver thread: the layer's last save

    def wait_for_save(self) -> None:
        if self._shared_steps is not None:  # its host copies are not waited for: the reuse gate orders them
            self._shared_steps.end_step()
        futures, self._save_futures, saves, self._step_saves = self._save_futures, [], self._step_saves, None
        failed: dict[tuple[str, int], BaseException] = {}
        for t, fut in futures:
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - the object stays incomplete: removed below
                failed.setdefault((t.request_id, t.group), exc)
        for t in saves or []:
            c = self._group_caches[t.group]
            report_save(t, failed.get((t.request_id, t.group)), self._counters, c.object_bytes, self._pools[t.group])
        handoffs, saved_at, self._handoffs, self._saved_at = self._handoffs, self._saved_at, [], {}
        report_step(handoffs, saved_at, saves or [], self._counters)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._shared_steps is not None:  # their host copies are no longer needed
            self._shared_steps.finished(finished_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._loader is not None:  # sync loads: reported in the pass that ran them
            self._loader.join()
            self._loader = None
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    # ---- stats and shutdown ------------------------------------------------------------------

    prom_name = "store"

    @classmethod
    def prom_counters(cls) -> dict[str, str]:
        return COUNTERS

    def take_counters(self) -> dict[str, float]:
        return self._counters.take()

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.SCHEDULER:
            self._client.close()
            return
        self._saver.shutdown(wait=True)
        pools, self._pools = self._pools, []
        for pool in pools:
            pool.close()
