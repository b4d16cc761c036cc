"""Shared by the config tests: the guide's configurations (as written, Ascend names, and with the
embedded backend names) and small helpers that edit them or collect a ConfigError's problems."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvcore.config.errors import ConfigError


def prefill_only(backend: str = "memcache") -> dict[str, Any]:
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "backend": backend,
            "use_layerwise": True,
            "layerwise_num_shared_buffers": 3,
            "layerwise_independent_layers": [0],
        },
    }


def decode_d2h(transfer_backend: str = "memfabric") -> dict[str, Any]:
    return {
        "kv_connector": "SfaRemoteD2HConnector",
        "kv_role": "kv_consumer",
        "kv_port": 20050,
        "kv_connector_extra_config": {"transfer_backend": transfer_backend, "use_layerwise": True},
    }


def prefill_multi(backend: str = "memcache", transfer_backend: str = "memfabric") -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "SfaRemoteD2HConnector",
                    "kv_role": "kv_producer",
                    "kv_port": 20050,
                    "kv_connector_extra_config": {"transfer_backend": transfer_backend},
                },
                prefill_only(backend),
            ]
        },
    }


GUIDE_ADDITIONAL = (
    '{"sparse_kv_offload_config": {"enabled": true, "topk_buffer_size": 4096, "dram_size_per_dp_GB": 128}}'
)


def errors_of(fn: Any, value: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        fn(value)
    return info.value.errors


def with_extra(base: dict[str, Any], **extra: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    out["kv_connector_extra_config"].update(extra)
    return out


def with_top(base: dict[str, Any], **top: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    out.update(top)
    return out


def without(base: dict[str, Any], key: str, *, extra: bool = False) -> dict[str, Any]:
    out = copy.deepcopy(base)
    (out["kv_connector_extra_config"] if extra else out).pop(key)
    return out


STORE = prefill_only()
D2H = decode_d2h()
MULTI = prefill_multi()
EXTRA = "kv_connector_extra_config"
SPARSE = "sparse_kv_offload_config"


def sparse(**values: Any) -> dict[str, Any]:
    return {SPARSE: values}
