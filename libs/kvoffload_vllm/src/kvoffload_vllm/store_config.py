"""The ``AscendStoreConnector``'s configuration: vLLM's ``kv_transfer_config`` checked and typed
(``kvcore.config.connectors.StoreConnectorConfig``: unknown keys, a backend vLLM does not run, a
missing lookup server — ``metastore`` or ``mooncake_master``, ``store_lookup`` — and pipeline
parallel are ``ConfigError``s naming the field); what it leaves out
taken from the seed's mmc files (``kvoffload_vllm.store_mmc``). The layerwise keys a node without
shared layer buffers does not act on are warned about (``layerwise_prefetch_layers`` included: with
them it is how far the reload loader runs ahead; ``layerwise_request_kv_gb``, the host copies'
budget, is checked against the model in ``kvoffload_vllm.request_kv_budget``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog
import vllm

from kvcore.config.connectors import StoreConnectorConfig
from kvcore.config.errors import ConfigError
from kvcore.config.names import STORE_CONNECTOR
from kvcore.config.parse import parse_kv_transfer_config
from kvoffload_vllm.request_kv import BUDGET_KEY
from kvoffload_vllm.shared_buffers import check_eager, check_vllm_version, requested, transfer_config_dict
from kvoffload_vllm.store_lookup import check_backend, check_lookup_server
from kvoffload_vllm.store_mmc import with_mmc_files
from kvoffload_vllm.unread_config import check_additional_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = structlog.get_logger("vllm.kvoffload.store")

# the keys shared layer buffers act on (``layerwise_prefetch_layers``: how far the loader runs ahead,
# ``kvoffload_vllm.shared_loader``)
SHARED_KEYS = ("layerwise_num_shared_buffers", "layerwise_independent_layers", "layerwise_prefetch_layers")


def store_config(vllm_config: VllmConfig) -> StoreConnectorConfig:
    """The typed AscendStoreConnector config (unknown keys are errors) of a one-rank vLLM; ConfigError
    names the field."""
    kv = vllm_config.kv_transfer_config
    if kv is None:
        raise ConfigError([f"kv_transfer_config: missing; the {STORE_CONNECTOR} is configured there"])
    parsed = parse_kv_transfer_config(transfer_config_dict(kv), strict=True)
    check_additional_config(vllm_config.additional_config, STORE_CONNECTOR)
    store = parsed.store
    if parsed.kv_connector != STORE_CONNECTOR or store is None:
        raise ConfigError(
            [f"kv_transfer_config.kv_connector: got {kv.kv_connector!r}; this class is {STORE_CONNECTOR}"]
        )
    check_backend(store)
    store = with_mmc_files(store)
    check_lookup_server(store)
    shared = requested(parsed.kv_role, store) is not None
    if shared:  # the connector changes vLLM's KV cache allocation (kvoffload_vllm.kv_cache_patch)
        check_vllm_version(vllm.__version__)
        check_eager(vllm_config.model_config.enforce_eager)
    used = {*SHARED_KEYS, BUDGET_KEY} if shared else set()
    unused = sorted(k for k in store.model_fields_set if k.startswith("layerwise_") and k not in used)
    if unused:
        log.warning(
            "kvoffload_config_ignored",
            keys=unused,
            reason="shared layer buffers are a kv_producer's with use_layerwise: true",
        )
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size > 1:
        raise ConfigError(
            [
                f"AscendStoreConnector: pipeline parallel is not supported; got pipeline_parallel_size "
                f"{par.pipeline_parallel_size} (tensor parallel is: each rank keeps its blocks under its own keys)"
            ]
        )
    return store
