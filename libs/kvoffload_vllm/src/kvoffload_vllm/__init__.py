"""kvoffload's KV connectors for vLLM's v1 KV-connector API.

A user switches one on with vLLM's own flag and the module path of this package::

    --kv-transfer-config '{"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "kvoffload_vllm",
        "kv_connector_extra_config": {"backend": "kvoffload", "metastore": "127.0.0.1:5000"}}'

The connector classes import vLLM, so they are loaded on first access (``kvoffload_vllm.layout``,
``kvoffload_vllm.plan`` and ``kvoffload_vllm.d2h_plan`` import without it). The P/D pair:
``SfaRemoteD2HConnector`` with ``kv_role`` ``kv_producer`` on the prefill (usually inside vLLM's
``MultiConnector`` next to the store) and ``kv_consumer`` on the decode; see ``kvoffload_vllm.d2h``.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["AscendStoreConnector", "SfaRemoteD2HConnector"]


def __getattr__(name: str):
    if name == "AscendStoreConnector":
        from kvoffload_vllm.store import AscendStoreConnector

        return AscendStoreConnector
    if name == "SfaRemoteD2HConnector":
        from kvoffload_vllm.d2h import SfaRemoteD2HConnector

        return SfaRemoteD2HConnector
    raise AttributeError(f"module 'kvoffload_vllm' has no attribute {name!r}")
