"""vLLM general plugin (entry point ``vllm.general_plugins``): registers kvoffload's connector names
and installs the shared-layer-buffer KV cache sizing (``kvoffload_vllm.kv_cache_patch``).

vLLM loads general plugins in every one of its processes (API server, engine core, workers). With
the names registered, ``"kv_connector": "AscendStoreConnector"`` resolves without
``kv_connector_module_path``, and vLLM's ``MultiConnector`` can rebuild its children's stats in the
API server by name (it looks connectors up in this registry only; without it, a MultiConnector with
a module-path child fails its first stats report). Registration is lazy: nothing heavy is imported.
"""

from __future__ import annotations

import kvoffload_vllm
from kvoffload_vllm import kv_cache_patch


def register_connectors() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    kv_cache_patch.install()
    for name in kvoffload_vllm.__all__:
        try:
            KVConnectorFactory.register_connector(name, "kvoffload_vllm", name)
        except ValueError:  # registered already (plugins may load twice in one process)
            pass
