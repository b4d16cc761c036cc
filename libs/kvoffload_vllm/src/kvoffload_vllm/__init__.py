"""kvoffload's KV connectors for vLLM's v1 KV-connector API.

A user switches one on with vLLM's own flag and the module path of this package::

    --kv-transfer-config '{"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "kvoffload_vllm",
        "kv_connector_extra_config": {"backend": "kvoffload", "metastore": "127.0.0.1:5000"}}'

The connector classes import vLLM, so they are loaded on first access (``kvoffload_vllm.layout``
and ``kvoffload_vllm.plan`` import without it).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["AscendStoreConnector"]


# The seed's other connector names: said plainly when a config asks for one (vLLM's getattr fails).
NOT_YET = {"SfaRemoteD2HConnector": "the remote D2H (P/D) connector under vLLM is not implemented yet; "
                                    "P/D runs on the reference engine (`kvoffload up`); see docs/vllm.md"}


def __getattr__(name: str):
    if name == "AscendStoreConnector":
        from kvoffload_vllm.store import AscendStoreConnector

        return AscendStoreConnector
    if name in NOT_YET:
        raise AttributeError(f"kvoffload_vllm.{name}: {NOT_YET[name]}")
    raise AttributeError(f"module 'kvoffload_vllm' has no attribute {name!r}")
