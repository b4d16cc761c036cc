"""The names the two JSON options accept: connectors, roles, backends, data operations, policies and keys.

Plain constants, importable without pydantic: ``kvcore.backends`` (which backends can run here),
``kvcore.hotcache.cache`` (the policies) and the services read them as well as the config models. The
host-pool backends' names are their ``kvcore.pool.registry`` entries' (``STORE_BACKENDS``), the P→D
transfer backends' their ``kvcore.transferregistry`` entries' (``TRANSFER_NAMES``).
"""

from __future__ import annotations

STORE_CONNECTOR = "AscendStoreConnector"
D2H_CONNECTOR = "SfaRemoteD2HConnector"
MULTI_CONNECTOR = "MultiConnector"
CONNECTORS = (STORE_CONNECTOR, D2H_CONNECTOR, MULTI_CONNECTOR)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# memfabric_hybrid.TransDataOpType members, lower-case (its TransferEngine's data operation; the
# library's default is SDMA)
MEMFABRIC_DATA_OPS = ("sdma", "host_rdma", "device_rdma", "device_urma", "device_uboe")
HOT_CACHE_POLICIES = ("lru", "slru", "clock")  # == kvcore.hotcache.POLICIES (config imports no engine code)
# the closest to Belady's optimum on the live indexer's selections, and the cheapest (kvcore.hotcache.cache)
DEFAULT_HOT_CACHE_POLICY = "clock"
LAYERWISE_KEYS = ("layerwise_num_shared_buffers", "layerwise_independent_layers", "layerwise_prefetch_layers")
SPARSE_KEY = "sparse_kv_offload_config"

# Keys of vLLM's own KVTransferConfig: accepted silently (vLLM consumes them), not stored here.
VLLM_TRANSFER_KEYS = frozenset(
    {
        "engine_id",
        "kv_buffer_device",
        "kv_buffer_size",
        "kv_rank",
        "kv_parallel_size",
        "kv_ip",
        "kv_connector_module_path",
        "enable_permute_local_kv",
        "kv_load_failure_policy",
    }
)
