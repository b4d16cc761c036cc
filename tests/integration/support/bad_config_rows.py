"""``ROWS``: ``test_bad_config``'s table, one row per invalid configuration a user can write: where it goes
(prefill / decode ``--kv-transfer-config``, ``--additional-config``, ``mmc-meta.conf`` / ``mmc-local.conf``,
the flags of every service) and the EXACT error it gets. ``{dir}`` in an expected message stands for the
row's temporary folder (the conf files live there)."""

from __future__ import annotations

import json

from bad_config_baselines import (
    CONNECTORS,
    D2H,
    D2H_P,
    DECODE_KV,
    DELETE,
    PREFILL_KV,
    PROXY_BACKENDS,
    ROLES,
    SP,
    SPARSE,
    STORE,
    STORE_P,
    WILDCARD,
    Row,
    edit,
)

# A table: each Row keeps its hand layout (where the config goes, the config, the EXACT message, the row's id,
# wrapped where the message wraps), so one row reads as one entry; `ruff format` would put every argument on
# a line of its own and double the table's length.
# fmt: off
ROWS = [
    # -- prefill --kv-transfer-config ----------------------------------------------------------------
    Row("prefill kv-transfer-config", '{"kv_connector": "MultiConnector",',
        "--kv-transfer-config: malformed JSON at line 1 column 35 (char 34): "
        "Expecting property name enclosed in double quotes", "malformed-json"),
    Row("prefill kv-transfer-config", "[1, 2]", "kv_transfer_config: got [1, 2] (list); must be a JSON object",
        "not-an-object"),
    Row("prefill kv-transfer-config",
        '{"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", "kv_role": "kv_consumer", '
        '"kv_connector_extra_config": {"backend": "kvoffload"}}',
        "--kv-transfer-config: key 'kv_role' appears twice in one JSON object; give each key once", "duplicate-key"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (("kv_connector",), DELETE)),
        f"kv_connector: required key is missing; must be one of {CONNECTORS}", "connector-missing"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (("kv_connector",), "MultiConector")),
        f"kv_connector: got 'MultiConector' (str); must be one of the supported connectors {CONNECTORS}; "
        "did you mean 'MultiConnector'?", "connector-typo"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (("kv_role",), "producer"), (D2H + ("kv_role",), "producer")),
        f"kv_role: got 'producer' (str); must be one of {ROLES}; did you mean 'kv_producer'?; "
        f"{D2H_P}.kv_role: got 'producer' (str); must be one of {ROLES}; did you mean 'kv_producer'?",
        "role-invalid-twice-both-listed"),
    Row("prefill kv-transfer-config",
        '{"kv_connector": "AscendStoreConnector", "kv_role": "kv_consumer", '
        '"kv_connector_extra_config": {"backend": "kvoffload"}}',
        "kv_role: got 'kv_consumer'; a prefill node must be 'kv_producer' (or 'kv_both')", "role-consumer"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("backend",), DELETE)),
        f"{STORE_P}.backend: required key is missing; must be one of 'kvoffload', 'memcache', 'mooncake'",
        "backend-missing"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("backend",), "redis")),
        f"{STORE_P}.backend: got 'redis' (str); must be one of 'kvoffload', 'memcache', 'mooncake'",
        "backend-unknown"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("backend",), "memcach")),
        f"{STORE_P}.backend: got 'memcach' (str); must be one of 'kvoffload', 'memcache', 'mooncake'; "
        "did you mean 'memcache'?",
        "backend-typo"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("backend",), "mooncake")),
        f"{STORE_P}.mooncake_master: required with backend 'mooncake'; must be \"HOST:PORT\" (the mooncake_master's "
        "RPC address, e.g. \"127.0.0.1:50051\")", "mooncake-master-missing"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("backend",), "mooncake"),
                                           (STORE + ("mooncake_master",), "127.0.0.1:50051"),
                                           (STORE + ("metastore",), "127.0.0.1:5000")),
        f"{STORE_P}.metastore: applies to backend 'kvoffload' only (the kvoffload-metastore that indexes the embedded "
        "pool; the mooncake backend keeps its index in the mooncake_master), not 'mooncake'; remove it",
        "mooncake-with-metastore"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("mooncake_master",), "127.0.0.1:50051")),
        f"{STORE_P}.mooncake_master: applies to backend 'mooncake' only (the mooncake backend's master), not "
        "'kvoffload'; remove it", "mooncake-master-without-mooncake"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("backend",), "mooncake"),
                                           (STORE + ("mooncake_master",), "127.0.0.1")),
        f"{STORE_P}.mooncake_master: got '127.0.0.1' (str); must be \"HOST:PORT\" (the mooncake_master's RPC address)",
        "mooncake-master-without-port"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("backend",), "mooncake"),
                                           (STORE + ("mooncake_master",), "127.0.0.1:50051"),
                                           (STORE + ("mooncake_namespace",), "a/b")),
        f"{STORE_P}.mooncake_namespace: got 'a/b' (str); must be a non-empty string without '/' or surrounding spaces",
        "mooncake-namespace-slash"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("use_layerwise",), "true")),
        f"{STORE_P}.use_layerwise: got 'true' (str); must be true or false", "use-layerwise-string"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("layerwise_num_shared_buffers",), 0)),
        f"{STORE_P}.layerwise_num_shared_buffers: got 0 (int); must be an int >= 1 or null", "buffers-zero"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("layerwise_num_shared_buffers",), "3")),
        f"{STORE_P}.layerwise_num_shared_buffers: got '3' (str); must be an int >= 1 or null", "buffers-string"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("layerwise_num_shared_buffers",), True)),
        f"{STORE_P}.layerwise_num_shared_buffers: got True (bool); must be an int >= 1 or null", "buffers-bool"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("layerwise_num_shared_buffers",), 2.0)),
        f"{STORE_P}.layerwise_num_shared_buffers: got 2.0 (float); must be an int >= 1 or null", "buffers-float"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("use_layerwise",), False)),
        f"{STORE_P}.layerwise_num_shared_buffers: got 3 while use_layerwise is false; "
        "shared buffers need use_layerwise: true", "buffers-without-layerwise"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("layerwise_independent_layers",), "none")),
        f"{STORE_P}.layerwise_independent_layers: got 'none' (str); "
        'must be "all" or a list of ints (layer indices; negatives count from the end)', "independent-string"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("layerwise_independent_layers",), [0, 7])),
        f"{STORE_P}.layerwise_independent_layers: got 7; must be in [-5, 4] (5 physical layers, MTP layers included)",
        "independent-past-the-end"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("layerwise_independent_layers",), [-6])),
        f"{STORE_P}.layerwise_independent_layers: got -6; must be in [-5, 4] (5 physical layers, MTP layers included)",
        "independent-before-the-start"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (STORE + ("layerwise_prefetch_layers",), 0)),
        f"{STORE_P}.layerwise_prefetch_layers: got 0 (int); must be an int >= 1 or null", "prefetch-zero"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (("kv_connector_extra_config", "connectors"), [])),
        "kv_connector_extra_config.connectors: got [] (list); must be a non-empty list of connector configs",
        "connectors-empty"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (D2H, PREFILL_KV)),
        f"{D2H_P}.kv_connector: got 'MultiConnector'; a MultiConnector cannot contain another MultiConnector",
        "connectors-nested-multi"),
    Row("prefill kv-transfer-config",
        edit(PREFILL_KV, (D2H, PREFILL_KV["kv_connector_extra_config"]["connectors"][1])),
        "kv_connector_extra_config.connectors[1].kv_connector: got 'AscendStoreConnector' again "
        "(also connectors[0]); at most one connector of each type", "connectors-duplicate-type"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (D2H + ("kv_role",), "kv_consumer")),
        f"{D2H_P}.kv_role: got 'kv_consumer'; must equal the MultiConnector's kv_role 'kv_producer'",
        "child-role-mismatch"),
    Row("prefill kv-transfer-config",
        edit(PREFILL_KV, (D2H + ("kv_connector_extra_config", "transfer_backend"), DELETE)),
        f"{D2H_P}.kv_connector_extra_config.transfer_backend: required for SfaRemoteD2HConnector; "
        "must be 'kvoffload', 'memfabric' or 'mooncake'", "transfer-backend-missing"),
    Row("prefill kv-transfer-config",
        edit(PREFILL_KV, (D2H + ("kv_connector_extra_config", "transfer_backend"), "nccl")),
        f"{D2H_P}.kv_connector_extra_config.transfer_backend: got 'nccl' (str); "
        "must be one of 'kvoffload', 'memfabric', 'mooncake'",
        "transfer-backend-unknown"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (D2H + ("kv_port",), 70000)),
        f"{D2H_P}.kv_port: got 70000 (int); must be an int in 1..65535 or null", "kv-port-too-big"),
    Row("prefill kv-transfer-config", edit(PREFILL_KV, (D2H + ("kv_port",), "20050")),
        f"{D2H_P}.kv_port: got '20050' (str); must be an int in 1..65535 or null", "kv-port-string"),
    Row("prefill kv-transfer-config", edit(DECODE_KV, (("kv_role",), "kv_producer")),
        "kv_connector: got 'SfaRemoteD2HConnector'; a prefill node needs an AscendStoreConnector "
        "(alone or inside a MultiConnector)", "no-store-connector"),
    Row("prefill kv-transfer-config",
        '{"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", "kv_connector_extra_config": [1]}',
        "kv_connector_extra_config: got [1] (list); must be a JSON object", "extra-config-list"),
    Row("prefill kv-transfer-config",
        edit(PREFILL_KV, (D2H + ("kv_port",), 0), (STORE + ("layerwise_num_shared_buffers",), 0)),
        f"{D2H_P}.kv_port: got 0 (int); must be an int in 1..65535 or null; "
        f"{STORE_P}.layerwise_num_shared_buffers: got 0 (int); must be an int >= 1 or null",
        "two-errors-listed-together"),
    # -- prefill --additional-config ---------------------------------------------------------------------
    Row("prefill additional-config", json.dumps(SPARSE),
        "sparse_kv_offload_config.enabled: got True on a prefill (kv_producer) node; never enable "
        "sparse_kv_offload_config on prefill (only keep_device_kv_cache: true, a debug mode, allows it)",
        "sparse-on-prefill"),
    # -- decode --kv-transfer-config -----------------------------------------------------------------------
    Row("decode kv-transfer-config",
        '{"kv_connector": "AscendStoreConnector", "kv_role": "kv_consumer", '
        '"kv_connector_extra_config": {"backend": "kvoffload"}}',
        "kv_connector: got 'AscendStoreConnector'; a decode node needs an SfaRemoteD2HConnector "
        "(alone or inside a MultiConnector)", "no-d2h-connector"),
    Row("decode kv-transfer-config", edit(DECODE_KV, (("kv_role",), "kv_producer")),
        "kv_role: got 'kv_producer'; a decode node must be 'kv_consumer' (or 'kv_both')", "role-producer"),
    Row("decode kv-transfer-config", edit(DECODE_KV, (("kv_port",), DELETE)),
        "kv_port: required on decode; the base of dp*tp consecutive control ports (int in 1..65535)",
        "kv-port-missing"),
    Row("decode kv-transfer-config", edit(DECODE_KV, (("kv_port",), 0)),
        "kv_port: got 0 (int); must be an int in 1..65535 or null", "kv-port-zero"),
    Row("decode kv-transfer-config", edit(DECODE_KV, (("kv_connector_extra_config", "transfer_backend"), DELETE)),
        "kv_connector_extra_config.transfer_backend: required for SfaRemoteD2HConnector; "
        "must be 'kvoffload', 'memfabric' or 'mooncake'", "transfer-backend-missing"),
    Row("decode kv-transfer-config", "kvoffload",
        "--kv-transfer-config: malformed JSON at line 1 column 1 (char 0): Expecting value", "not-json"),
    # -- decode sizes (flags combined with the configs) -------------------------------------------------
    Row("decode sizes", {"kv": edit(DECODE_KV, (("kv_port",), 65535)), "dp": 2},
        "kv_port: got 65535; dp=2 x tp=1 = 2 control ports need 65535..65536, but the last port must be <= 65535 "
        "(use kv_port <= 65534)", "control-ports-past-65535"),
    Row("decode sizes", {"max_num_seqs": 8, "max_model_len": 65536},
        "sparse_kv_offload_config.dram_size_per_dp_GB: got 1 (1073741824 bytes); the host pool must hold "
        "max_num_seqs 8 x 65536 tokens (max_model_len 65536 rounded up to block_size 16) x 4160 bytes/token = "
        "2181038080 bytes; needs dram_size_per_dp_GB >= 3", "host-pool-too-small"),
    Row("decode sizes", {"index_topk": None},
        "sparse_kv_offload_config.enabled: got True but the model has no indexer (index_topk is None); "
        "sparse offload needs a sparse-attention model", "model-without-indexer"),
    Row("decode sizes", {"max_num_seqs": 0}, "max_num_seqs: got 0 (int); must be an int >= 1", "max-num-seqs-zero"),
    # -- decode --additional-config -------------------------------------------------------------------------
    Row("decode additional-config", '{"sparse_kv_offload_config": {"enabled": true',
        "--additional-config: malformed JSON at line 1 column 46 (char 45): Expecting ',' delimiter", "malformed-json"),
    Row("decode additional-config", '"x"', "additional_config: got 'x' (str); must be a JSON object",
        "not-an-object"),
    Row("decode additional-config", '{"sparse_kv_offload_config": []}',
        "sparse_kv_offload_config: got [] (list); must be a JSON object", "sparse-not-an-object"),
    Row("decode additional-config", edit(SPARSE, (SP + ("enabled",), "yes")),
        "sparse_kv_offload_config.enabled: got 'yes' (str); must be true or false", "enabled-string"),
    Row("decode additional-config", edit(SPARSE, (SP + ("enabled",), False)),
        "sparse_kv_offload_config.enabled: got False on a decode (kv_consumer) node; must be true "
        "(or keep_device_kv_cache: true, a debug mode)", "sparse-disabled"),
    Row("decode additional-config", json.dumps({"sparse_kv_ofload_config": SPARSE["sparse_kv_offload_config"]}),
        "sparse_kv_offload_config.enabled: got False on a decode (kv_consumer) node; must be true "
        "(or keep_device_kv_cache: true, a debug mode)", "sparse-key-typo-leaves-it-disabled"),
    Row("decode additional-config", edit(SPARSE, (SP + ("topk_buffer_size",), 32)),
        "sparse_kv_offload_config.topk_buffer_size: got 32; must be >= index_topk 64 "
        "(2x index_topk = 128 is a good start)", "topk-below-index-topk"),
    Row("decode additional-config", edit(SPARSE, (SP + ("topk_buffer_size",), 72)),
        "sparse_kv_offload_config.topk_buffer_size: got 72; must be divisible by block_size 16 (72 % 16 = 8)",
        "topk-not-block-multiple"),
    Row("decode additional-config", edit(SPARSE, (SP + ("hot_cache_policy",), "fifo")),
        "sparse_kv_offload_config.hot_cache_policy: got 'fifo' (str); must be one of 'lru', 'slru', 'clock'",
        "hot-cache-policy-unknown"),
    Row("decode additional-config", edit(SPARSE, (SP + ("topk_buffer_size",), 0)),
        "sparse_kv_offload_config.topk_buffer_size: got 0 (int); must be an int >= 1", "topk-zero"),
    Row("decode additional-config", edit(SPARSE, (SP + ("dram_size_per_dp_GB",), 1.5)),
        "sparse_kv_offload_config.dram_size_per_dp_GB: got 1.5 (float); must be whole GiB as an integer > 0 "
        '(e.g. 128, not 1.5 or "10GB")', "dram-fraction"),
    Row("decode additional-config", edit(SPARSE, (SP + ("dram_size_per_dp_GB",), "10GB")),
        "sparse_kv_offload_config.dram_size_per_dp_GB: got '10GB' (str); must be whole GiB as an integer > 0 "
        '(e.g. 128, not 1.5 or "10GB")', "dram-with-unit"),
    Row("decode additional-config",
        '{"sparse_kv_offload_config": {"enabled": true, "topk_buffer_size": 128, "dram_size_per_dp_GB": NaN}}',
        "sparse_kv_offload_config.dram_size_per_dp_GB: got nan (float); must be whole GiB as an integer > 0 "
        '(e.g. 128, not 1.5 or "10GB")', "dram-nan"),
    Row("decode additional-config", edit(SPARSE, (SP + ("keep_device_kv_cache",), "false")),
        "sparse_kv_offload_config.keep_device_kv_cache: got 'false' (str); must be true or false", "keep-string"),
    # -- mmc-meta.conf ---------------------------------------------------------------------------------------
    Row("mmc meta conf", "ock.mmc.meta_service_url = http://127.0.0.1:5000\n",
        "ock.mmc.meta_service_url ({dir}/mmc-meta.conf:1): expected tcp://HOST:PORT with a port in 1..65535, "
        "got 'http://127.0.0.1:5000'", "url-scheme"),
    Row("mmc meta conf", "ock.mmc.meta_service_url = tcp://127.0.0.1:70000\n",
        "ock.mmc.meta_service_url ({dir}/mmc-meta.conf:1): expected tcp://HOST:PORT with a port in 1..65535, "
        "got 'tcp://127.0.0.1:70000'", "url-port"),
    Row("mmc meta conf", "# lease\nock.mmc.meta.lease_ttl_ms = 30s\n",
        "ock.mmc.meta.lease_ttl_ms ({dir}/mmc-meta.conf:2): expected an integer >= 1, got '30s'", "ttl-with-unit"),
    Row("mmc meta conf", "ock.mmc.meta.lease_ttl_ms = -5\n",
        "ock.mmc.meta.lease_ttl_ms ({dir}/mmc-meta.conf:1): expected an integer >= 1, got '-5'", "ttl-negative"),
    Row("mmc meta conf", "ock.mmc.meta.lease_ttl_ms = 999999999\n",
        "lease_ttl_ms: Input should be less than or equal to 86400000, got 999999999", "ttl-over-a-day"),
    Row("mmc meta conf", "ock.mmc.meta.lease_ttl_ms 30000\n",
        "{dir}/mmc-meta.conf:1: expected 'key = value', got 'ock.mmc.meta.lease_ttl_ms 30000'", "line-without-equals"),
    Row("mmc meta conf", "ock.mmc.log_level = info\nock.mmc.log_level = error\n",
        "{dir}/mmc-meta.conf:2: ock.mmc.log_level is repeated (first at {dir}/mmc-meta.conf:1)", "key-repeated"),
    Row("mmc meta conf", "ock.mmc.log_level = verbose\n",
        "ock.mmc.log_level ({dir}/mmc-meta.conf:1): expected one of debug, info, warning, error, critical, "
        "got 'verbose'", "log-level"),
    # -- mmc-local.conf -------------------------------------------------------------------------------------
    Row("mmc local conf", "ock.mmc.local_service.world_size = 0\n",
        "ock.mmc.local_service.world_size ({dir}/mmc-local.conf:1): expected an integer >= 1, got '0'", "world-zero"),
    Row("mmc local conf", "ock.mmc.local_service.world_size = 2.5\n",
        "ock.mmc.local_service.world_size ({dir}/mmc-local.conf:1): expected an integer >= 1, got '2.5'",
        "world-fraction"),
    Row("mmc local conf", "ock.mmc.local_service.dram.size = 10XB\n",
        "ock.mmc.local_service.dram.size ({dir}/mmc-local.conf:1): expected a size like 10GB or 512MB, got '10XB'",
        "dram-unit"),
    Row("mmc local conf", "ock.mmc.local_service.dram.size = 0GB\n",
        "ock.mmc.local_service.dram.size ({dir}/mmc-local.conf:1): expected a size > 0, got '0GB'", "dram-zero"),
    Row("mmc local conf", "ock.mmc.local_service.dram.size = 1.5GB\n",
        "ock.mmc.local_service.dram.size ({dir}/mmc-local.conf:1): expected a size like 10GB or 512MB, got '1.5GB'",
        "dram-fraction"),
    Row("mmc meta+local conf", ("ock.mmc.meta_service_url = tcp://127.0.0.1:5000\n",
                                "ock.mmc.meta_service_url = tcp://127.0.0.1:5001\n"),
        "ock.mmc.meta_service_url = tcp://127.0.0.1:5001 ({dir}/mmc-local.conf:1) differs from "
        "ock.mmc.meta_service_url = tcp://127.0.0.1:5000 ({dir}/mmc-meta.conf:1): both files must name the same "
        "MetaService", "meta-and-local-disagree"),
    Row("mmc meta+local conf", ("ock.mmc.meta_service.config_store_url = tcp://127.0.0.1:6000\n",
                                "ock.mmc.local_service.config_store_url = tcp://127.0.0.2:6000\n"),
        "ock.mmc.local_service.config_store_url = tcp://127.0.0.2:6000 ({dir}/mmc-local.conf:1) differs from "
        "ock.mmc.meta_service.config_store_url = tcp://127.0.0.1:6000 ({dir}/mmc-meta.conf:1): the LocalService's "
        "config store must be the MetaService's", "config-stores-disagree"),
    Row("mmc local conf", "ock.mmc.local_service.protocol = sdma\n",
        "ock.mmc.local_service.protocol ({dir}/mmc-local.conf:1): expected one of host_rdma, host_urma, host_tcp, "
        "host_shm, device_rdma, device_urma, device_uboe, device_sdma, got 'sdma'", "protocol-unknown"),
    Row("mmc conf env", {"MMC_META_CONFIG_PATH": "{dir}/absent.conf"},
        "cannot read conf file {dir}/absent.conf: No such file or directory", "env-names-a-missing-file"),
    # -- kvoffload-decode / kvoffload-prefill flags (checked before the model loads) --------------------
    Row("decode flags", ["--block-size", "0"], "--block-size: got 0; must be an int >= 1", "block-size"),
    Row("decode flags", ["--max-num-seqs", "-1"], "--max-num-seqs: got -1; must be an int >= 1", "max-num-seqs"),
    Row("decode flags", ["--dp-rank", "-1"], "--dp-rank: got -1; must be an int >= 0", "dp-rank"),
    Row("decode flags", ["--metaserver-timeout-s", "inf"],
        "--metaserver-timeout-s: got inf; must be a finite number > 0", "metaserver-timeout-infinite"),
    Row("decode flags", ["--port", "70000"], "--port: got 70000; must be a TCP port in 1..65535", "port"),
    Row("decode flags", ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 1}'],
        "--speculative-config.method: got 'eagle'; must be one of deepseek_mtp, mtp (drafts come from the model's "
        "MTP layer)", "speculative-method"),
    Row("decode flags", ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}'],
        "--speculative-config.num_speculative_tokens: got 3; must be 1 (one MTP draft token per step is what this "
        "engine runs)", "speculative-count"),
    Row("decode flags", ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1, "model": "x"}'],
        "--speculative-config: unknown key(s) model; this decode takes method and num_speculative_tokens",
        "speculative-unknown-key"),
    Row("prefill flags", ["--chunk-size", "0"], "--chunk-size: got 0; must be an int >= 1", "chunk-size"),
    Row("prefill flags", ["--host-pool-gb", "-1"], "--host-pool-gb: got -1.0; must be a finite number > 0",
        "host-pool-negative"),
    Row("prefill flags", ["--read-timeout-s", "nan"], "--read-timeout-s: got nan; must be a finite number > 0",
        "read-timeout-nan"),
    Row("prefill flags", ["--data-port", "70000", "--max-model-len", "0"],
        "--max-model-len: got 0; must be an int >= 1; "
        "--data-port: got 70000; must be a TCP port in 0..65535 (0: any free port)", "two-flags-listed-together"),
    # -- kvoffload-metastore flags ---------------------------------------------------------------------------
    Row("metastore flags", ["--port", "70000"], "port: Input should be less than or equal to 65535, got 70000",
        "port"),
    Row("metastore flags", ["--dram-size", "lots"], "--dram-size: expected a size like 10GB or 512MB, got 'lots'",
        "dram-size"),
    Row("metastore flags", ["--world-size", "0"], "world_size: Input should be greater than or equal to 1, got 0",
        "world-size"),
    Row("metastore flags", ["--heartbeat-timeout-ms", "0"],
        "heartbeat_timeout_ms: Input should be greater than or equal to 1, got 0", "heartbeat-timeout"),
    Row("metastore flags", ["--grace-s", "inf"], "grace_s: Input should be a finite number, got inf",
        "grace-infinite"),
    Row("metastore flags", ["--log-level", "verbose"],
        "log_level: Input should be 'debug', 'info', 'warning', 'error' or 'critical', got 'verbose'", "log-level"),
    # -- kvoffload-proxy flags --------------------------------------------------------------------------------
    Row("proxy flags", ["--host", "0.0.0.0", *PROXY_BACKENDS], f"--host '0.0.0.0' {WILDCARD}", "host-wildcard"),
    Row("proxy flags", ["--host", "::", *PROXY_BACKENDS], f"--host '::' {WILDCARD}", "host-wildcard-ipv6"),
    Row("proxy flags", ["--prefiller-hosts", "0.0.0.0", "--prefiller-ports", "8100",
                        "--decoder-hosts", "127.0.0.1", "--decoder-ports", "8200"],
        f"--prefiller-hosts '0.0.0.0' {WILDCARD}", "backend-wildcard"),
    Row("proxy flags", ["--prefiller-hosts", "127.0.0.1", "127.0.0.2", "--prefiller-ports", "8100",
                        "--decoder-hosts", "127.0.0.1", "--decoder-ports", "8200"],
        "--prefiller-ports: 1 port(s) for 2 --prefiller-hosts; give one port per host, in the same order "
        "(e.g. --prefiller-hosts 10.0.0.1 10.0.0.2 --prefiller-ports 8100 8100)", "ports-count"),
    Row("proxy flags", ["--prefiller-hosts", "127.0.0.1", "--prefiller-ports", "8100",
                        "--decoder-hosts", "127.0.0.1", "--decoder-ports", "70000"],
        "--decoder-ports: 70000 is not a TCP port (1-65535)", "backend-port"),
    Row("proxy flags", ["--prefiller-hosts", "127.0.0.1", "--prefiller-ports", "8100",
                        "--decoder-hosts", "127.0.0.1", "127.0.0.1", "--decoder-ports", "8200", "8200"],
        "--decoder-hosts/--decoder-ports: http://127.0.0.1:8200 listed more than once", "backend-duplicate"),
    Row("proxy flags", ["--prefiller-hosts", "bad host!", "--prefiller-ports", "8100",
                        "--decoder-hosts", "127.0.0.1", "--decoder-ports", "8200"],
        "--prefiller-hosts 'bad host!' is neither an IP address nor a host name", "backend-host-syntax"),
    Row("proxy flags", ["--port", "8100", *PROXY_BACKENDS],
        "--prefiller-hosts/--prefiller-ports: http://127.0.0.1:8100 is this proxy's own --host/--port; "
        "give the prefiller's address", "backend-is-the-proxy-itself"),
    Row("proxy flags", ["--port", "0", *PROXY_BACKENDS], "--port 0: Input should be greater than or equal to 1",
        "port-zero"),
    Row("proxy flags", ["--max-retries", "21", *PROXY_BACKENDS],
        "--max-retries 21: Input should be less than or equal to 20", "retries"),
    Row("proxy flags", ["--metaserver-url", "ftp://10.0.0.5/v1/metaserver", *PROXY_BACKENDS],
        "--metaserver-url 'ftp://10.0.0.5/v1/metaserver': 'ftp://10.0.0.5/v1/metaserver' must be an http(s) URL "
        "such as http://10.0.0.5:9000/v1/metaserver", "metaserver-url-scheme"),
    Row("proxy flags", ["--metaserver-url", "http://0.0.0.0:9000/v1/metaserver", *PROXY_BACKENDS],
        "--metaserver-url 'http://0.0.0.0:9000/v1/metaserver': 'http://0.0.0.0:9000/v1/metaserver' names a "
        "wildcard host; decoders cannot reach it", "metaserver-url-wildcard"),
    Row("proxy flags", ["--api-key", "sec ret", *PROXY_BACKENDS],
        "--api-key: must be a non-empty string without whitespace", "api-key-whitespace-not-echoed"),
    Row("proxy flags", ["--request-timeout-s", "0", *PROXY_BACKENDS],
        "--request-timeout-s 0.0: Input should be greater than 0", "timeout-zero"),
    Row("proxy flags", ["--request-timeout-s", "inf", *PROXY_BACKENDS],
        "--request-timeout-s inf: Input should be a finite number", "timeout-infinite"),
    Row("proxy flags", ["--shutdown-grace-s", "nan", *PROXY_BACKENDS],
        "--shutdown-grace-s nan: Input should be a finite number", "grace-nan"),
    Row("proxy flags", ["--max-request-bytes", "10", *PROXY_BACKENDS],
        "--max-request-bytes 10: Input should be greater than or equal to 1024", "max-request-bytes"),
]
# fmt: on
