"""The guide's keys that a vLLM server running a kvoffload connector would otherwise leave unread:
each is refused or named in a warning at start-up, never silently ignored.

- ``--additional-config`` ``sparse_kv_offload_config`` (the guide's decode: a host pool of the full
  KV, a device hot buffer of top-k entries). vLLM reads nothing of it: sparse decode runs in the
  kvoffload decode service (``kvoffload-decode``), and on CUDA in vLLM's own HiSparse. With
  ``enabled: true`` the server is refused (it would keep the whole KV in vLLM's own cache, not the
  host memory the config sizes); with it off (or ``enabled`` absent) a warning names it.
- the D2H connector's ``use_layerwise`` (the guide's decode sets it): the vLLM pull is layerwise
  whatever it says; ``false`` (given) is named in a warning. A prefill's ``kv_port`` (the guide's
  producer gives one): it listens on none; a port other than vLLM's default is named in a warning.
- the store's layerwise keys a server does not use: a warning (``kvoffload_vllm.store_config``).
"""

from __future__ import annotations

from typing import Any

import structlog

from kvcore.config.errors import ConfigError
from kvcore.config.names import SPARSE_KEY

log = structlog.get_logger("vllm.kvoffload.config")

VLLM_DEFAULT_KV_PORT = 14579  # vLLM's KVTransferConfig.kv_port when none is given

SPARSE_DECODE = (
    "vLLM has no sparse KV offload: it runs in the kvoffload decode service (kvoffload-decode "
    f"--additional-config '{{\"{SPARSE_KEY}\": ...}}'), and on CUDA in vLLM's own HiSparse"
)


def check_additional_config(additional_config: object, connector: str) -> None:
    """Refuse (``ConfigError``) or warn about the guide's ``--additional-config`` keys vLLM leaves unread
    on a server running ``connector`` (``additional_config``: vLLM's, a dict or a platform's object)."""
    if not isinstance(additional_config, dict):
        return  # a platform's own config object: not the guide's JSON
    sparse = additional_config.get(SPARSE_KEY)
    if sparse is None:
        return
    enabled = sparse.get("enabled") if isinstance(sparse, dict) else None
    if enabled is True:
        raise ConfigError(
            [
                f"additional_config.{SPARSE_KEY}.enabled: true, but {SPARSE_DECODE}; this vLLM server "
                f"({connector}) would keep its whole KV in vLLM's own cache: remove {SPARSE_KEY} (or run the "
                "decode as kvoffload-decode)"
            ]
        )
    log.warning(
        "kvoffload_config_ignored",
        keys=[f"additional_config.{SPARSE_KEY}"],
        connector=connector,
        reason=f"{SPARSE_DECODE}; it is not enabled here, so nothing changes",
    )


def check_d2h_keys(role: str | None, kv_port: int, extra: dict[str, Any]) -> None:
    """Warn about the D2H connector's keys the vLLM connector does not act on: ``use_layerwise: false``
    (the pull is layerwise whatever it says) and a prefill's own ``kv_port`` (``role`` "kv_producer"
    given another port than vLLM's default: the prefill listens on none)."""
    if extra.get("use_layerwise") is False:
        log.warning(
            "kvoffload_config_ignored",
            keys=["kv_connector_extra_config.use_layerwise"],
            reason="the vLLM D2H pull is layerwise whatever use_layerwise says (each layer is pulled "
            "as soon as its attention ran)",
        )
    if role == "kv_producer" and kv_port != VLLM_DEFAULT_KV_PORT:
        log.warning(
            "kvoffload_config_ignored",
            keys=["kv_transfer_config.kv_port"],
            reason="a prefill (kv_producer) listens on no kv_port: its LayerSource takes "
            "kv_connector_extra_config.data_port, and each request names its decode's control port",
        )
