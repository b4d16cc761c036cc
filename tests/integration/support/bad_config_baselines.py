"""The valid configurations ``test_bad_config``'s rows each break in one place: the prefill's and decode's
``--kv-transfer-config`` and ``--additional-config``, the decode's sizes and the proxy's backends; the
paths into them (``edit``) and the message prefixes those paths get; and ``Row``, one table row."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from dsamodel.presets import tiny_config
from kvoffload_engine.model_layout import kv_layout

CONFIG = tiny_config(dtype="float32")  # 5 cache layers (4 + 1 MTP), index_topk 64, 4160 bytes/token
LAYOUT = kv_layout(CONFIG, 16)

# ---- valid baselines every row mutates ----------------------------------------------------------

PREFILL_KV = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_producer",
    "kv_connector_extra_config": {
        "connectors": [
            {
                "kv_connector": "SfaRemoteD2HConnector",
                "kv_role": "kv_producer",
                "kv_port": 20050,
                "kv_connector_extra_config": {"transfer_backend": "kvoffload"},
            },
            {
                "kv_connector": "AscendStoreConnector",
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {
                    "backend": "kvoffload",
                    "use_layerwise": True,
                    "layerwise_num_shared_buffers": 3,
                    "layerwise_independent_layers": [0],
                },
            },
        ]
    },
}
DECODE_KV = {
    "kv_connector": "SfaRemoteD2HConnector",
    "kv_role": "kv_consumer",
    "kv_port": 20050,
    "kv_connector_extra_config": {"transfer_backend": "kvoffload", "use_layerwise": True},
}
SPARSE = {"sparse_kv_offload_config": {"enabled": True, "topk_buffer_size": 128, "dram_size_per_dp_GB": 1}}
DECODE_SIZES = {"index_topk": CONFIG.index_topk, "max_num_seqs": 2, "max_model_len": 256}
PROXY_BACKENDS = [
    "--prefiller-hosts",
    "127.0.0.1",
    "--prefiller-ports",
    "8100",
    "--decoder-hosts",
    "127.0.0.1",
    "--decoder-ports",
    "8200",
]

D2H = ("kv_connector_extra_config", "connectors", 0)  # the prefill's SfaRemoteD2HConnector
STORE = ("kv_connector_extra_config", "connectors", 1, "kv_connector_extra_config")  # its store extra config
SP = ("sparse_kv_offload_config",)
DELETE = object()

# the dotted prefixes of those paths in messages
D2H_P = "kv_connector_extra_config.connectors[0]"
STORE_P = "kv_connector_extra_config.connectors[1].kv_connector_extra_config"
CONNECTORS = "'AscendStoreConnector', 'SfaRemoteD2HConnector', 'MultiConnector'"
ROLES = "'kv_producer', 'kv_consumer', 'kv_both'"
WILDCARD = (
    "is a wildcard address: decoders call the proxy's /v1/metaserver at the address it advertises, and "
    "a wildcard one is not reachable; give the reachable address of this host (127.0.0.1 on one machine, "
    "the node's IP across machines)"
)


def edit(base: dict, *changes: tuple[tuple, Any]) -> str:
    """``base`` with each (path, value) set (DELETE removes the key), as the JSON a user types."""
    data = copy.deepcopy(base)
    for path, value in changes:
        cur = data
        for part in path[:-1]:
            cur = cur[part]
        if value is DELETE:
            del cur[path[-1]]
        else:
            cur[path[-1]] = value
    return json.dumps(data)


@dataclass(frozen=True)
class Row:
    where: str
    input: Any
    error: str
    id: str
