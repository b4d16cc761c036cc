"""A node's two JSON options taken together: what the prefill and decode settings share.

``parse_both`` parses ``--kv-transfer-config`` and ``--additional-config`` (parsed objects pass
through) and reports the problems of both at once; ``store_of`` and ``d2h_of`` find a connector
alone or inside a MultiConnector, with the dotted path prefix its errors must carry.
"""

from __future__ import annotations

from typing import Any

from kvcore.config.additional import AdditionalConfig, SparseKVOffloadConfig
from kvcore.config.connectors import D2HConnectorConfig, StoreConnectorConfig
from kvcore.config.errors import ConfigError, describe_value
from kvcore.config.kv_transfer import KVTransferConfig
from kvcore.config.names import D2H_CONNECTOR, SPARSE_KEY, STORE_CONNECTOR
from kvcore.config.parse import parse_additional_config, parse_kv_transfer_config
from kvcore.transferregistry import TRANSFER_NAMES, either

KVConfigInput = str | dict[str, Any] | KVTransferConfig
AdditionalInput = str | dict[str, Any] | AdditionalConfig | None


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive(errors: list[str], **sizes: Any) -> None:
    """Append an error to ``errors`` for each size that is not an int >= 1."""
    for name, value in sizes.items():
        if not is_int(value) or value < 1:
            errors.append(f"{name}: got {describe_value(value)}; must be an int >= 1")


def parse_both(kv: KVConfigInput, additional: AdditionalInput) -> tuple[KVTransferConfig, AdditionalConfig]:
    """Both configs parsed (parsed objects pass through); ConfigError lists the problems of both."""
    errors: list[str] = []
    kv_config = additional_config = None
    try:
        kv_config = kv if isinstance(kv, KVTransferConfig) else parse_kv_transfer_config(kv)
    except ConfigError as exc:
        errors.extend(exc.errors)
    try:
        additional_config = (
            additional if isinstance(additional, AdditionalConfig) else parse_additional_config(additional)
        )
    except ConfigError as exc:
        errors.extend(exc.errors)
    if errors or kv_config is None or additional_config is None:
        raise ConfigError(errors)
    return kv_config, additional_config


def store_of(kv: KVTransferConfig) -> tuple[str, StoreConnectorConfig] | None:
    """(path prefix, extra config) of the AscendStoreConnector, self or child."""
    found = kv.locate(STORE_CONNECTOR)
    if found is None or not isinstance(found[1].kv_connector_extra_config, StoreConnectorConfig):
        return None
    return found[0], found[1].kv_connector_extra_config


def d2h_of(kv: KVTransferConfig) -> tuple[str, KVTransferConfig, D2HConnectorConfig] | None:
    """(path prefix, connector config, extra config) of the SfaRemoteD2HConnector, self or child."""
    found = kv.locate(D2H_CONNECTOR)
    if found is None or not isinstance(found[1].kv_connector_extra_config, D2HConnectorConfig):
        return None
    return found[0], found[1], found[1].kv_connector_extra_config


def missing_transfer_backend(prefix: str) -> str:
    """The error of an SfaRemoteD2HConnector without ``transfer_backend`` (``prefix``: its path)."""
    return (
        f"{prefix}kv_connector_extra_config.transfer_backend: required for {D2H_CONNECTOR}; "
        f"must be {either(TRANSFER_NAMES)}"
    )


def debug_warnings(sparse: SparseKVOffloadConfig) -> list[str]:
    """The warning of ``keep_device_kv_cache: true`` (a debug mode), if set."""
    if sparse.keep_device_kv_cache:
        return [f"{SPARSE_KEY}.keep_device_kv_cache: true keeps the full KV cache on the device (debug only)"]
    return []
