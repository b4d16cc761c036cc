"""``SfaRemoteD2HConnector`` for vLLM: the P/D pull of a prefill's KV into a decode, layer by layer.

The seed's remote D2H semantics on vLLM's ``KVConnectorBase_V1``, over the ``proto/`` Transfer
contract (the same one the kvoffload prefill and decode services speak)::

    prefill: {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_producer",
              "kv_connector_module_path": "kvoffload_vllm",
              "kv_connector_extra_config": {"transfer_backend": "kvoffload"}}
    decode:  {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer", "kv_port": 20050,
              "kv_connector_module_path": "kvoffload_vllm", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"transfer_backend": "kvoffload"}}

(the prefill's usually sits in a ``MultiConnector`` next to the ``AscendStoreConnector``);
``"transfer_backend": "mooncake"`` on both moves the blocks through Mooncake Transfer Engine instead
of the LayerSource's gRPC stream (``kvoffload_vllm.d2h_engine``). It
supports vLLM's hybrid KV cache manager (``SupportsHMA``): every attention layer of every KV cache
group moves through its own group's block table and block size (``kvoffload_vllm.d2h_layers``), and
vLLM's null block (a sliding window's blocks outside the window) is never read nor written. The
kvoffload proxy sends a client request to the decode first, with ``kv_transfer_params``
``{"do_remote_prefill": true, "metaserver": URL, "request_id": ID}``; the decode registers its
control endpoint there, and the proxy then sends the prefill the request with that endpoint in its
``kv_transfer_params``.

Producer (prefill)
    scheduler  ``update_state_after_alloc`` notes the decode a request sends to;
               ``build_connector_meta`` turns each step's prompt tokens into sends
               (``kvoffload_vllm.d2h_plan``) with the request's blocks per group as the scheduler's
               KV cache manager holds them then (the workers' sliding-window tables keep stale ids);
               ``request_finished_all_groups`` delays the free of a request's blocks until every
               read of them was answered (``get_finished`` reports it).
    worker     ``kvoffload_vllm.producer``: a LayerSource gRPC server streams blocks out of vLLM's
               cache; after each layer's attention ``save_kv_layer`` announces the layer to the
               decode (ReadReady), while the forward goes on.
Consumer (decode)
    scheduler  ``get_num_new_matched_tokens`` answers "the whole prompt, asynchronously" for a
               ``do_remote_prefill`` request (vLLM then computes the last prompt token itself, which
               samples the first output token); ``update_state_after_alloc`` passes the request's
               blocks (per group) to the worker; ``request_finished_all_groups`` of a request still
               loading delays the free until the worker let go of its blocks.
    worker     ``kvoffload_vllm.d2h_consumer``: a Transfer gRPC server on ``kv_port + dp_rank × tp +
               tp_rank`` takes the layout, the ReadReady announcements (pulls each layer into the
               request's blocks) and the heartbeats; the registration POST to the proxy's
               ``/v1/metaserver``; ``get_finished`` reports requests whose every layer landed, and a
               failed or silent prefill's requests as failed receives (vLLM recomputes them under
               ``kv_load_failure_policy: "recompute"``, else fails them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvcore.config.names import D2H_CONNECTOR
from kvoffload_vllm.d2h_layers import D2HLayers
from kvoffload_vllm.d2h_plan import SendPlanner, peer_of
from kvoffload_vllm.d2h_settings import d2h_settings
from kvoffload_vllm.d2h_step import D2HStepMetadata, Recv
from kvoffload_vllm.kv_groups import kv_groups
from kvoffload_vllm.layout import group_model_ids
from kvoffload_vllm.plan import scheduled_requests
from kvoffload_vllm.stats import CountingConnector
from openai_api.transfer_params import KVTransferParams, parse_transfer_params

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from kvoffload_vllm.d2h_consumer import Consumer
    from kvoffload_vllm.producer import Producer

log = structlog.get_logger("vllm.kvoffload.d2h")


class SfaRemoteD2HConnector(CountingConnector, KVConnectorBase_V1, SupportsHMA):
    """See the module docstring; one instance per role (scheduler / worker)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = d2h_settings(vllm_config)
        self.producer_role = self.settings.role == "kv_producer"
        self._groups = kv_groups(kv_cache_config.kv_cache_groups, D2H_CONNECTOR)
        # the whole model's id: a TP rank's heads are one slice of it, unless every rank holds them all
        shards = 1 if self.settings.kv_replicated else self.settings.tp_size
        group_ids = group_model_ids(vllm_config, self._groups, shards)
        self.model_id = ",".join(group_ids)  # one group: its id, as the store's
        # worker: a prefill's Producer or a decode's Consumer, once the caches are registered
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = SendPlanner()
            self._matched: dict[str, int] = {}  # consumer: local prefix tokens at the remote match
            self._new_recvs: list[Recv] = []
            self._loading: set[str] = set()  # consumer: requests whose pull the worker has not reported
            self._cancelled: list[str] = []
        log.info(
            "kvoffload_d2h_connector",
            role=role.name,
            kv_role=self.settings.role,
            model_id=self.model_id,
            block_sizes=[g.block_size for g in self._groups],
            control_port=self.settings.control_port,
            advertise_host=self.settings.advertise_host,
        )

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = transfer_params_of(request)
        if self.producer_role or params is None or not params.do_remote_prefill:
            return 0, False
        if params.metaserver is None or params.request_id is None:
            log.warning(
                "kvoffload_d2h_no_metaserver",
                request_id=request.request_id,
                reason="do_remote_prefill without metaserver and request_id: the prompt is computed here",
            )
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._matched[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = transfer_params_of(request)
        prompt_len = len(request.prompt_token_ids or ())
        if self.producer_role:
            try:
                peer = peer_of(params)
            except ValueError as exc:
                log.error("kvoffload_d2h_bad_params", request_id=request.request_id, error=str(exc))
                return
            if peer is not None:
                self._planner.allocated(request.request_id, peer, prompt_len)
            return
        local = self._matched.pop(request.request_id, None)
        if local is None or num_external_tokens == 0 or params is None or not params.do_remote_prefill:
            return
        # once: a preempted request resumes from its own blocks (vLLM keeps the dict, so it is set there)
        assert request.kv_transfer_params is not None  # params were parsed from it
        request.kv_transfer_params["do_remote_prefill"] = False
        self._new_recvs.append(
            Recv(
                request.request_id,
                str(params.request_id),
                str(params.metaserver),
                params.registration_token,
                prompt_len,
                local,
                tuple(tuple(ids) for ids in blocks.get_block_ids()),
            )
        )
        self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = D2HStepMetadata()
        if not self.producer_role:
            meta.recvs, self._new_recvs = self._new_recvs, []
            meta.cancelled, self._cancelled = self._cancelled, []
            return meta
        for s in scheduled_requests(scheduler_output):
            if self._planner.sends(s.req_id):
                send = self._planner.step(s.req_id, self._block_table(s.req_id), s.computed, s.scheduled)
                meta.sends += [send] if send else []
        return meta

    def _block_table(self, req_id: str) -> tuple[list[int], ...]:
        """The request's blocks per KV cache group as the scheduler holds them now: a sliding window's
        blocks that fell out of it are vLLM's null block (the scheduler output names new blocks only)."""
        manager: KVCacheManager | None = self._kv_cache_manager
        if manager is None:
            raise RuntimeError(f"{D2H_CONNECTOR}: vLLM did not bind its KV cache manager (bind_kv_cache_manager)")
        return manager.get_block_ids(req_id)

    def update_connector_output(self, connector_output) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.discard(rid)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.producer_role:
            return self._planner.finished(request.request_id), None
        self._matched.pop(request.request_id, None)
        if request.request_id in self._loading:  # the worker may be writing its blocks: it frees them
            self._loading.discard(request.request_id)
            self._cancelled.append(request.request_id)
            return True, None
        return False, None

    # ---- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = D2HLayers.of(self._groups, kv_caches, self._kv_cache_config.num_blocks)
        if self.producer_role:
            from kvoffload_vllm.producer import Producer

            self._producer = Producer(self.settings, self.model_id, layers)
        else:
            from kvoffload_vllm.d2h_consumer import Consumer

            self._consumer = Consumer(self.settings, self.model_id, layers)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, D2HStepMetadata)
        if self._consumer is not None:
            self._consumer.begin_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # the consumer's loads are asynchronous: vLLM waits through get_finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._producer is not None:
            self._producer.layer_saved(layer_name, self._get_connector_metadata())

    def wait_for_save(self) -> None:
        if self._producer is not None:
            self._producer.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._producer is not None:
            return KVConnectorTransferResults(finished_sending=self._producer.finished(finished_req_ids))
        if self._consumer is not None:
            done, failed = self._consumer.finished()
            return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)
        return KVConnectorTransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # failed pulls are reported per request (failed_recving), see get_transfer_results

    # ---- stats and shutdown ------------------------------------------------------------------

    prom_name = "d2h"

    @classmethod
    def prom_counters(cls) -> dict[str, str]:
        from kvoffload_vllm.d2h_consumer import COUNTERS as CONSUMER
        from kvoffload_vllm.producer import COUNTERS as PRODUCER

        return {
            **{f"producer_{k}": v for k, v in PRODUCER.items()},
            **{f"consumer_{k}": v for k, v in CONSUMER.items()},
        }

    def take_counters(self) -> dict[str, float]:
        side, role = (self._producer, "producer") if self.producer_role else (self._consumer, "consumer")
        return {f"{role}_{k}": v for k, v in side.take_counters().items()} if side is not None else {}

    def shutdown(self) -> None:
        for side in (self._producer, self._consumer):
            if side is not None:
                side.close()
        self._producer = self._consumer = None


def transfer_params_of(request: Request) -> KVTransferParams | None:
    """The request's ``kv_transfer_params``, typed; None when it has none, or when they are malformed
    (logged: the request then runs without a transfer)."""
    try:
        return parse_transfer_params(request.kv_transfer_params)
    except ValueError as exc:
        log.error("kvoffload_d2h_bad_params", request_id=request.request_id, error=str(exc))
        return None
