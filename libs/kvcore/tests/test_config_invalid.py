"""Invalid --kv-transfer-config / --additional-config: every rule names the field by dotted path,
the value and the rule; every problem is reported in one pass; ConfigError's shape."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from config_support import (
    D2H,
    EXTRA,
    MULTI,
    SPARSE,
    STORE,
    decode_d2h,
    errors_of,
    prefill_multi,
    prefill_only,
    sparse,
    with_extra,
    with_top,
    without,
)
from pydantic import ValidationError

from kvcore.config.additional import AdditionalConfig, SparseKVOffloadConfig
from kvcore.config.connectors import StoreConnectorConfig
from kvcore.config.errors import ConfigError
from kvcore.config.kv_transfer import KVTransferConfig
from kvcore.config.parse import parse_additional_config, parse_kv_transfer_config

# ------------------------------------------------------------------------------------------------
# invalid --kv-transfer-config: (config, field path, words the message must contain)


INVALID_KV = [
    (
        with_top(STORE, kv_connector="MooncakeConnector"),
        "kv_connector",
        ["'MooncakeConnector' (str)", "AscendStoreConnector", "SfaRemoteD2HConnector", "MultiConnector"],
    ),
    (with_top(STORE, kv_connector="AscendStoreConector"), "kv_connector", ["did you mean 'AscendStoreConnector'?"]),
    (without(STORE, "kv_connector"), "kv_connector", ["required key is missing", "AscendStoreConnector"]),
    (with_top(STORE, kv_role="producer"), "kv_role", ["'producer' (str)", "kv_producer", "kv_consumer", "kv_both"]),
    (without(STORE, "kv_role"), "kv_role", ["required key is missing", "kv_producer"]),
    (with_top(D2H, kv_port="20050"), "kv_port", ["'20050' (str)", "must be an int in 1..65535"]),
    (with_top(D2H, kv_port=True), "kv_port", ["True (bool)", "must be an int in 1..65535"]),
    (with_top(D2H, kv_port=0), "kv_port", ["got 0 (int)", "1..65535"]),
    (with_top(D2H, kv_port=65536), "kv_port", ["got 65536 (int)", "1..65535"]),
    (with_top(D2H, kv_port=20050.0), "kv_port", ["20050.0 (float)", "int"]),
    (with_top(STORE, kv_connector_extra_config=[]), EXTRA, ["[] (list)", "JSON object"]),
    (
        with_extra(STORE, backend="redis"),
        f"{EXTRA}.backend",
        ["'redis' (str)", "'kvoffload'", "'memcache'", "'mooncake'"],
    ),
    (with_extra(STORE, backend="memcahce"), f"{EXTRA}.backend", ["did you mean 'memcache'?"]),
    (without(STORE, "backend", extra=True), f"{EXTRA}.backend", ["required key is missing", "'kvoffload'"]),
    (with_top(STORE, kv_connector_extra_config=None), f"{EXTRA}.backend", ["required key is missing"]),
    (with_extra(STORE, use_layerwise="true"), f"{EXTRA}.use_layerwise", ["'true' (str)", "must be true or false"]),
    (with_extra(STORE, use_layerwise=1), f"{EXTRA}.use_layerwise", ["1 (int)", "must be true or false"]),
    (
        with_extra(STORE, layerwise_num_shared_buffers=True),
        f"{EXTRA}.layerwise_num_shared_buffers",
        ["got True (bool); must be an int >= 1"],
    ),
    (
        with_extra(STORE, layerwise_num_shared_buffers=0),
        f"{EXTRA}.layerwise_num_shared_buffers",
        ["got 0 (int); must be an int >= 1"],
    ),
    (
        with_extra(STORE, layerwise_num_shared_buffers="3"),
        f"{EXTRA}.layerwise_num_shared_buffers",
        ["'3' (str)", "must be an int >= 1"],
    ),
    (
        with_extra(STORE, layerwise_num_shared_buffers=2.0),
        f"{EXTRA}.layerwise_num_shared_buffers",
        ["2.0 (float)", "must be an int >= 1"],
    ),
    (
        with_extra(STORE, layerwise_independent_layers="0"),
        f"{EXTRA}.layerwise_independent_layers",
        ["'0' (str)", 'must be "all" or a list of ints'],
    ),
    (
        with_extra(STORE, layerwise_independent_layers=0),
        f"{EXTRA}.layerwise_independent_layers",
        ["0 (int)", 'must be "all" or a list of ints'],
    ),
    (
        with_extra(STORE, layerwise_independent_layers=[0, "1"]),
        f"{EXTRA}.layerwise_independent_layers",
        ['must be "all" or a list of ints'],
    ),
    (
        with_extra(STORE, layerwise_independent_layers=[True]),
        f"{EXTRA}.layerwise_independent_layers",
        ['must be "all" or a list of ints'],
    ),
    (
        with_extra(STORE, layerwise_independent_layers="ALL"),
        f"{EXTRA}.layerwise_independent_layers",
        ['must be "all" or a list of ints'],
    ),
    (
        with_extra(STORE, layerwise_prefetch_layers=0),
        f"{EXTRA}.layerwise_prefetch_layers",
        ["got 0 (int); must be an int >= 1"],
    ),
    (with_extra(STORE, layerwise_prefetch_layers=False), f"{EXTRA}.layerwise_prefetch_layers", ["False (bool)"]),
    (
        with_extra(D2H, transfer_backend="rdma"),
        f"{EXTRA}.transfer_backend",
        ["'rdma' (str)", "'kvoffload'", "'memfabric'"],
    ),
    (with_extra(D2H, transfer_backend=1), f"{EXTRA}.transfer_backend", ["1 (int)", "'memfabric'"]),
    (with_extra(D2H, use_layerwise="no"), f"{EXTRA}.use_layerwise", ["must be true or false"]),
    (with_extra(MULTI, connectors=[]), f"{EXTRA}.connectors", ["[] (list)", "non-empty list"]),
    (with_extra(MULTI, connectors="x"), f"{EXTRA}.connectors", ["'x' (str)", "non-empty list"]),
    (
        {"kv_connector": "MultiConnector", "kv_role": "kv_producer"},
        f"{EXTRA}.connectors",
        ["required key is missing", "non-empty list"],
    ),
    (
        with_extra(MULTI, connectors=[prefill_only(), prefill_multi()]),
        f"{EXTRA}.connectors[1].kv_connector",
        ["'MultiConnector'", "cannot contain another MultiConnector"],
    ),
    (
        with_extra(MULTI, connectors=[prefill_only(), prefill_only("kvoffload")]),
        f"{EXTRA}.connectors[1].kv_connector",
        ["'AscendStoreConnector' again", "connectors[0]", "at most one connector of each type"],
    ),
    (
        with_extra(MULTI, connectors=[decode_d2h(), prefill_only()]),
        f"{EXTRA}.connectors[0].kv_role",
        ["'kv_consumer'", "must equal the MultiConnector's kv_role 'kv_producer'"],
    ),
    (
        with_extra(MULTI, connectors=[prefill_only("redis")]),
        f"{EXTRA}.connectors[0].{EXTRA}.backend",
        ["'redis' (str)"],
    ),
    (
        with_extra(MULTI, connectors=[with_top(D2H, kv_role="kv_producer"), with_extra(STORE, use_layerwise="y")]),
        f"{EXTRA}.connectors[1].{EXTRA}.use_layerwise",
        ["'y' (str)", "must be true or false"],
    ),
    (
        with_extra(MULTI, connectors=[with_top(D2H, kv_role="kv_producer", kv_port=-1)]),
        f"{EXTRA}.connectors[0].kv_port",
        ["got -1 (int)"],
    ),
    ([1, 2], "kv_transfer_config", ["[1, 2] (list)", "JSON object"]),
]


@pytest.mark.parametrize(("raw", "path", "words"), INVALID_KV)
def test_invalid_kv_transfer_config(raw: Any, path: str, words: list[str]) -> None:
    errors = errors_of(parse_kv_transfer_config, raw)
    matching = [e for e in errors if e.startswith(f"{path}: ")]
    assert matching, errors
    for word in words:
        assert any(word in e for e in matching), (word, matching)
    assert "validation error" not in "; ".join(errors)  # no raw pydantic dump


def test_all_problems_in_one_pass() -> None:
    raw = with_extra(
        prefill_multi(),
        connectors=[
            {
                "kv_connector": "SfaRemoteD2HConnector",
                "kv_role": "kv_consumer",
                "kv_port": 70000,
                "kv_connector_extra_config": {"transfer_backend": "rdma"},
            },
            with_extra(STORE, layerwise_num_shared_buffers=True, backend="x"),
            prefill_multi(),
        ],
    )
    with pytest.raises(ConfigError) as info:
        parse_kv_transfer_config(raw)
    paths = sorted(e.split(": ")[0] for e in info.value.errors)
    assert paths == sorted(
        [
            "kv_connector_extra_config.connectors[0].kv_port",
            "kv_connector_extra_config.connectors[0].kv_connector_extra_config.transfer_backend",
            "kv_connector_extra_config.connectors[0].kv_role",
            "kv_connector_extra_config.connectors[1].kv_connector_extra_config.backend",
            "kv_connector_extra_config.connectors[1].kv_connector_extra_config.layerwise_num_shared_buffers",
            "kv_connector_extra_config.connectors[2].kv_connector",
        ]
    )
    assert str(info.value) == "; ".join(info.value.errors)


def test_invalid_connector_does_not_add_noise_for_extra_config() -> None:
    errors = errors_of(parse_kv_transfer_config, with_top(STORE, kv_connector="Nope"))
    assert len(errors) == 1 and errors[0].startswith("kv_connector: ")


# ------------------------------------------------------------------------------------------------
# invalid --additional-config


INVALID_ADDITIONAL = [
    (sparse(enabled="true"), f"{SPARSE}.enabled", ["'true' (str)", "must be true or false"]),
    (sparse(enabled=1), f"{SPARSE}.enabled", ["1 (int)", "must be true or false"]),
    (sparse(keep_device_kv_cache="false"), f"{SPARSE}.keep_device_kv_cache", ["must be true or false"]),
    (sparse(miss_prefetch="on"), f"{SPARSE}.miss_prefetch", ["'on' (str)", "must be true or false"]),
    (
        sparse(hot_cache_policy="lfu"),
        f"{SPARSE}.hot_cache_policy",
        ["'lfu' (str)", "must be one of 'lru', 'slru', 'clock'"],
    ),
    (sparse(topk_buffer_size=0), f"{SPARSE}.topk_buffer_size", ["got 0 (int)", "must be an int"]),
    (sparse(topk_buffer_size=-128), f"{SPARSE}.topk_buffer_size", ["got -128 (int)"]),
    (sparse(topk_buffer_size="4096"), f"{SPARSE}.topk_buffer_size", ["'4096' (str)", "must be an int"]),
    (sparse(topk_buffer_size=True), f"{SPARSE}.topk_buffer_size", ["True (bool)", "must be an int"]),
    (sparse(topk_buffer_size=4096.0), f"{SPARSE}.topk_buffer_size", ["4096.0 (float)"]),
    (sparse(dram_size_per_dp_GB=1.5), f"{SPARSE}.dram_size_per_dp_GB", ["1.5 (float)", "whole GiB as an integer"]),
    (sparse(dram_size_per_dp_GB="10GB"), f"{SPARSE}.dram_size_per_dp_GB", ["'10GB' (str)", "whole GiB as an integer"]),
    (sparse(dram_size_per_dp_GB=0), f"{SPARSE}.dram_size_per_dp_GB", ["got 0 (int)", "whole GiB as an integer > 0"]),
    (sparse(dram_size_per_dp_GB=True), f"{SPARSE}.dram_size_per_dp_GB", ["True (bool)", "whole GiB"]),
    ({SPARSE: None}, SPARSE, ["None (NoneType)", "JSON object"]),
    ({SPARSE: [1]}, SPARSE, ["[1] (list)", "JSON object"]),
    ('[{"enabled": true}]', "additional_config", ["(list)", "JSON object"]),
]


@pytest.mark.parametrize(("raw", "path", "words"), INVALID_ADDITIONAL)
def test_invalid_additional_config(raw: Any, path: str, words: list[str]) -> None:
    errors = errors_of(parse_additional_config, raw)
    matching = [e for e in errors if e.startswith(f"{path}: ")]
    assert matching, errors
    for word in words:
        assert any(word in e for e in matching), (word, matching)


def test_additional_config_all_problems_in_one_pass() -> None:
    errors = errors_of(parse_additional_config, sparse(enabled=1, topk_buffer_size="8", dram_size_per_dp_GB=1.5))
    assert [e.split(": ")[0] for e in errors] == [
        f"{SPARSE}.enabled",
        f"{SPARSE}.topk_buffer_size",
        f"{SPARSE}.dram_size_per_dp_GB",
    ]


# ------------------------------------------------------------------------------------------------
# ConfigError and direct construction


def test_config_error_shape() -> None:
    error = ConfigError(["a: x", "b: y"])
    assert isinstance(error, ValueError)
    assert error.errors == ["a: x", "b: y"] and str(error) == "a: x; b: y"
    copy_ = pickle.loads(pickle.dumps(error))
    assert copy_.errors == error.errors and str(copy_) == str(error)
    assert ConfigError("only").errors == ["only"]


def test_direct_construction_is_strict_with_friendly_messages() -> None:
    with pytest.raises(ValidationError) as info:
        StoreConnectorConfig(backend="memcache", layerwise_num_shared_buffers=True)
    converted = ConfigError.from_validation_error(info.value, "kv_connector_extra_config")
    assert converted.errors == ["layerwise_num_shared_buffers: got True (bool); must be an int >= 1 or null"]
    with pytest.raises(ValidationError):
        KVTransferConfig(kv_connector="AscendStoreConnector", kv_role="kv_producer")  # backend missing
    assert AdditionalConfig().sparse_kv_offload_config == SparseKVOffloadConfig()
