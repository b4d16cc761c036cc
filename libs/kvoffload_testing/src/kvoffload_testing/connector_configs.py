"""The connector configs of the reference services: the ``--kv-transfer-config`` and
``--additional-config`` JSON a loopback stack gives its prefills and decodes.

They are the guide's (MultiConnector prefill with layerwise reuse, sparse-offload decode); only
``backend`` / ``transfer_backend`` name kvoffload's backends: the embedded ``"kvoffload"`` ones, or
with a ``mooncake_master`` (``HOST:PORT``) the prefill's host pool on Mooncake Store, and with
``transfer`` another ``kvcore.transferregistry`` entry's name (``"mooncake"``: Mooncake Transfer
Engine) the P→D pull on that backend.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvcore.transferregistry import EMBEDDED


def prefill_store_config(buffers: int = 3, mooncake_master: str | None = None) -> dict:
    """The prefill's AscendStoreConnector extra config: the embedded pool, or with ``mooncake_master``
    (``HOST:PORT``) the mooncake backend."""
    pool = (
        {"backend": "kvoffload"}
        if mooncake_master is None
        else {"backend": "mooncake", "mooncake_master": mooncake_master}
    )
    return {**pool, "use_layerwise": True, "layerwise_num_shared_buffers": buffers, "layerwise_independent_layers": [0]}


def offload_only_kv_transfer_config(
    buffers: int = 3, mooncake_master: str | None = None, independent: Sequence[int] | str = (0,)
) -> str:
    """A prefill with an AscendStoreConnector alone (offload-only: it serves complete requests)."""
    extra = {
        **prefill_store_config(buffers, mooncake_master),
        "layerwise_independent_layers": independent if isinstance(independent, str) else list(independent),
    }
    return json.dumps(
        {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra}
    )


def producer_multi_connector(d2h: dict, store: dict) -> str:
    """A prefill's MultiConnector: the SfaRemoteD2HConnector (``d2h``: the rest of its entry) and the
    AscendStoreConnector (``store``: the rest of its entry), both ``kv_producer``."""
    return json.dumps(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "connectors": [
                    {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_producer", **d2h},
                    {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", **store},
                ]
            },
        }
    )


def prefill_kv_transfer_config(
    kv_port: int, buffers: int = 3, mooncake_master: str | None = None, transfer: str = EMBEDDED
) -> str:
    return producer_multi_connector(
        {"kv_port": kv_port, "kv_connector_extra_config": {"transfer_backend": transfer}},
        {"kv_connector_extra_config": prefill_store_config(buffers, mooncake_master)},
    )


def decode_kv_transfer_config(kv_port: int, transfer: str = EMBEDDED) -> str:
    return json.dumps(
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": "kv_consumer",
            "kv_port": kv_port,
            "kv_connector_extra_config": {"transfer_backend": transfer, "use_layerwise": True},
        }
    )


def decode_additional_config(topk_buffer_size: int = 128, dram_gb: int = 1) -> str:
    return json.dumps(
        {
            "sparse_kv_offload_config": {
                "enabled": True,
                "topk_buffer_size": topk_buffer_size,
                "dram_size_per_dp_GB": dram_gb,
            }
        }
    )
