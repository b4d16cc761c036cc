"""Parsing of --kv-transfer-config / --additional-config: guide examples, every rule, warnings."""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any

import pytest
from pydantic import ValidationError
from structlog.testing import capture_logs

from kvcore.config import (
    AdditionalConfig,
    ConfigError,
    D2HConnectorConfig,
    KVTransferConfig,
    MultiConnectorConfig,
    SparseKVOffloadConfig,
    StoreConnectorConfig,
    parse_additional_config,
    parse_kv_transfer_config,
)

# ------------------------------------------------------------------------------------------------
# the guide's configurations, as written (Ascend names) and with the embedded backend names


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


GUIDE_ADDITIONAL = '{"sparse_kv_offload_config": {"enabled": true, "topk_buffer_size": 4096, "dram_size_per_dp_GB": 128}}'


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


# ------------------------------------------------------------------------------------------------
# valid configurations


@pytest.mark.parametrize("backend", ["memcache", "kvoffload"])
@pytest.mark.parametrize("as_json", [False, True])
def test_guide_prefill_only(backend: str, as_json: bool) -> None:
    raw = prefill_only(backend)
    config = parse_kv_transfer_config(json.dumps(raw) if as_json else raw)
    assert config.kv_connector == "AscendStoreConnector"
    assert config.is_producer and not config.is_consumer
    assert config.store == StoreConnectorConfig(
        backend=backend, use_layerwise=True, layerwise_num_shared_buffers=3, layerwise_independent_layers=[0]
    )
    assert config.store is not None and config.store.layerwise_independent_layers == (0,)
    assert config.d2h is None
    assert config.warnings == []


@pytest.mark.parametrize("transfer_backend", ["memfabric", "kvoffload"])
def test_guide_decode(transfer_backend: str) -> None:
    config = parse_kv_transfer_config(json.dumps(decode_d2h(transfer_backend)))
    assert config.is_consumer and not config.is_producer
    assert config.store is None
    assert config.d2h is config
    assert config.d2h.kv_port == 20050
    assert config.kv_connector_extra_config == D2HConnectorConfig(transfer_backend=transfer_backend, use_layerwise=True)


@pytest.mark.parametrize(("backend", "transfer_backend"), [("memcache", "memfabric"), ("kvoffload", "kvoffload")])
def test_guide_multi_connector(backend: str, transfer_backend: str) -> None:
    config = parse_kv_transfer_config(prefill_multi(backend, transfer_backend))
    assert isinstance(config.kv_connector_extra_config, MultiConnectorConfig)
    assert [c.kv_connector for c in config.leaves] == ["SfaRemoteD2HConnector", "AscendStoreConnector"]
    assert config.store is not None and config.store.backend == backend
    assert config.d2h is not None and config.d2h.kv_port == 20050
    assert config.d2h.kv_connector_extra_config == D2HConnectorConfig(transfer_backend=transfer_backend)
    assert config.locate("AscendStoreConnector") == ("kv_connector_extra_config.connectors[1].", config.leaves[1])
    assert config.locate("MultiConnector") == ("", config)


def test_store_defaults_and_all() -> None:
    config = parse_kv_transfer_config(
        {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"backend": "kvoffload"}}
    )
    assert config.is_producer and config.is_consumer
    assert config.store is not None and config.store.model_dump() == {
        "backend": "kvoffload",
        "use_layerwise": False,
        "layerwise_num_shared_buffers": None,
        "layerwise_independent_layers": (0,),
        "layerwise_prefetch_layers": None,
        "metastore": None,
        "host_pool_gb": None,
        "mooncake_master": None,
        "mooncake_namespace": "kvoffload",
        "mooncake_lease_ttl_ms": 5000,
    }
    assert config.warnings == []
    every = parse_kv_transfer_config(with_extra(prefill_only(), layerwise_independent_layers="all"))
    assert every.store is not None and every.store.layerwise_independent_layers == "all"
    dupes = parse_kv_transfer_config(with_extra(prefill_only(), layerwise_independent_layers=[0, 0, -1]))
    assert dupes.store is not None and dupes.store.layerwise_independent_layers == (0, 0, -1)


def test_d2h_extra_config_optional() -> None:
    config = parse_kv_transfer_config({"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer"})
    assert config.kv_connector_extra_config == D2HConnectorConfig(transfer_backend=None, use_layerwise=False)
    assert config.kv_port is None


def test_configs_are_frozen() -> None:
    config = parse_kv_transfer_config(prefill_only())
    with pytest.raises(ValidationError):
        config.kv_role = "kv_consumer"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        config.store.backend = "kvoffload"  # type: ignore[union-attr,misc]


@pytest.mark.parametrize("value", [GUIDE_ADDITIONAL, json.loads(GUIDE_ADDITIONAL)])
def test_guide_additional_config(value: Any) -> None:
    config = parse_additional_config(value)
    assert config.sparse_kv_offload_config == SparseKVOffloadConfig(
        enabled=True, topk_buffer_size=4096, dram_size_per_dp_GB=128, keep_device_kv_cache=False
    )
    assert config.sparse.dram_bytes_per_dp == 128 * 1024**3


@pytest.mark.parametrize("value", [None, "", "  ", "{}", {}])
def test_additional_config_defaults(value: Any) -> None:
    sparse = parse_additional_config(value).sparse_kv_offload_config
    assert (sparse.enabled, sparse.topk_buffer_size, sparse.dram_size_per_dp_GB, sparse.keep_device_kv_cache) == (
        False,
        4096,
        128,
        False,
    )
    assert sparse.hot_cache_policy == "lru"
    assert parse_additional_config({SPARSE: {"hot_cache_policy": "slru"}}).sparse.hot_cache_policy == "slru"
    assert sparse.miss_prefetch is False
    assert parse_additional_config({SPARSE: {"miss_prefetch": True}}).sparse.miss_prefetch is True


def test_other_features_keys_are_kept_silently() -> None:
    with capture_logs() as logs:
        config = parse_additional_config({"ascend_scheduler_config": {"enabled": True}, "torchair_graph_config": {}})
    assert config.warnings == []
    assert logs == []
    assert config.model_extra == {"ascend_scheduler_config": {"enabled": True}, "torchair_graph_config": {}}


# ------------------------------------------------------------------------------------------------
# invalid --kv-transfer-config: (config, field path, words the message must contain)

STORE = prefill_only()
D2H = decode_d2h()
MULTI = prefill_multi()
EXTRA = "kv_connector_extra_config"

INVALID_KV = [
    (with_top(STORE, kv_connector="MooncakeConnector"), "kv_connector",
     ["'MooncakeConnector' (str)", "AscendStoreConnector", "SfaRemoteD2HConnector", "MultiConnector"]),
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
    (with_extra(STORE, backend="redis"), f"{EXTRA}.backend",
     ["'redis' (str)", "'kvoffload'", "'memcache'", "'mooncake'"]),
    (with_extra(STORE, backend="memcahce"), f"{EXTRA}.backend", ["did you mean 'memcache'?"]),
    (without(STORE, "backend", extra=True), f"{EXTRA}.backend", ["required key is missing", "'kvoffload'"]),
    (with_top(STORE, kv_connector_extra_config=None), f"{EXTRA}.backend", ["required key is missing"]),
    (with_extra(STORE, use_layerwise="true"), f"{EXTRA}.use_layerwise", ["'true' (str)", "must be true or false"]),
    (with_extra(STORE, use_layerwise=1), f"{EXTRA}.use_layerwise", ["1 (int)", "must be true or false"]),
    (with_extra(STORE, layerwise_num_shared_buffers=True), f"{EXTRA}.layerwise_num_shared_buffers",
     ["got True (bool); must be an int >= 1"]),
    (with_extra(STORE, layerwise_num_shared_buffers=0), f"{EXTRA}.layerwise_num_shared_buffers",
     ["got 0 (int); must be an int >= 1"]),
    (with_extra(STORE, layerwise_num_shared_buffers="3"), f"{EXTRA}.layerwise_num_shared_buffers",
     ["'3' (str)", "must be an int >= 1"]),
    (with_extra(STORE, layerwise_num_shared_buffers=2.0), f"{EXTRA}.layerwise_num_shared_buffers",
     ["2.0 (float)", "must be an int >= 1"]),
    (with_extra(STORE, layerwise_independent_layers="0"), f"{EXTRA}.layerwise_independent_layers",
     ["'0' (str)", 'must be "all" or a list of ints']),
    (with_extra(STORE, layerwise_independent_layers=0), f"{EXTRA}.layerwise_independent_layers",
     ["0 (int)", 'must be "all" or a list of ints']),
    (with_extra(STORE, layerwise_independent_layers=[0, "1"]), f"{EXTRA}.layerwise_independent_layers",
     ['must be "all" or a list of ints']),
    (with_extra(STORE, layerwise_independent_layers=[True]), f"{EXTRA}.layerwise_independent_layers",
     ['must be "all" or a list of ints']),
    (with_extra(STORE, layerwise_independent_layers="ALL"), f"{EXTRA}.layerwise_independent_layers",
     ['must be "all" or a list of ints']),
    (with_extra(STORE, layerwise_prefetch_layers=0), f"{EXTRA}.layerwise_prefetch_layers",
     ["got 0 (int); must be an int >= 1"]),
    (with_extra(STORE, layerwise_prefetch_layers=False), f"{EXTRA}.layerwise_prefetch_layers", ["False (bool)"]),
    (with_extra(D2H, transfer_backend="rdma"), f"{EXTRA}.transfer_backend", ["'rdma' (str)", "'kvoffload'", "'memfabric'"]),
    (with_extra(D2H, transfer_backend=1), f"{EXTRA}.transfer_backend", ["1 (int)", "'memfabric'"]),
    (with_extra(D2H, use_layerwise="no"), f"{EXTRA}.use_layerwise", ["must be true or false"]),
    (with_extra(MULTI, connectors=[]), f"{EXTRA}.connectors", ["[] (list)", "non-empty list"]),
    (with_extra(MULTI, connectors="x"), f"{EXTRA}.connectors", ["'x' (str)", "non-empty list"]),
    ({"kv_connector": "MultiConnector", "kv_role": "kv_producer"}, f"{EXTRA}.connectors",
     ["required key is missing", "non-empty list"]),
    (with_extra(MULTI, connectors=[prefill_only(), prefill_multi()]), f"{EXTRA}.connectors[1].kv_connector",
     ["'MultiConnector'", "cannot contain another MultiConnector"]),
    (with_extra(MULTI, connectors=[prefill_only(), prefill_only("kvoffload")]), f"{EXTRA}.connectors[1].kv_connector",
     ["'AscendStoreConnector' again", "connectors[0]", "at most one connector of each type"]),
    (with_extra(MULTI, connectors=[decode_d2h(), prefill_only()]), f"{EXTRA}.connectors[0].kv_role",
     ["'kv_consumer'", "must equal the MultiConnector's kv_role 'kv_producer'"]),
    (with_extra(MULTI, connectors=[prefill_only("redis")]), f"{EXTRA}.connectors[0].{EXTRA}.backend", ["'redis' (str)"]),
    (with_extra(MULTI, connectors=[with_top(D2H, kv_role="kv_producer"), with_extra(STORE, use_layerwise="y")]),
     f"{EXTRA}.connectors[1].{EXTRA}.use_layerwise", ["'y' (str)", "must be true or false"]),
    (with_extra(MULTI, connectors=[with_top(D2H, kv_role="kv_producer", kv_port=-1)]), f"{EXTRA}.connectors[0].kv_port",
     ["got -1 (int)"]),
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


@pytest.mark.parametrize(
    ("fn", "text", "option"),
    [
        (parse_kv_transfer_config, '{"kv_connector": "AscendStoreConnector",, }', "--kv-transfer-config"),
        (parse_kv_transfer_config, "{'kv_role': 'kv_producer'}", "--kv-transfer-config"),
        (parse_additional_config, '{"sparse_kv_offload_config": {"enabled": tru}}', "--additional-config"),
    ],
)
def test_malformed_json_names_option_and_position(fn: Any, text: str, option: str) -> None:
    errors = errors_of(fn, text)
    with pytest.raises(json.JSONDecodeError) as decoded:
        json.loads(text)
    where = f"line {decoded.value.lineno} column {decoded.value.colno}"
    assert len(errors) == 1 and errors[0].startswith(f"{option}: malformed JSON at {where}"), errors


@pytest.mark.parametrize("value", [42, ["a"], b"{}"])
def test_wrong_python_input_type(value: Any) -> None:
    errors = errors_of(parse_kv_transfer_config, value)
    assert any("JSON" in e for e in errors)


def test_all_problems_in_one_pass() -> None:
    raw = with_extra(
        prefill_multi(),
        connectors=[
            {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer", "kv_port": 70000,
             "kv_connector_extra_config": {"transfer_backend": "rdma"}},
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

SPARSE = "sparse_kv_offload_config"


def sparse(**values: Any) -> dict[str, Any]:
    return {SPARSE: values}


INVALID_ADDITIONAL = [
    (sparse(enabled="true"), f"{SPARSE}.enabled", ["'true' (str)", "must be true or false"]),
    (sparse(enabled=1), f"{SPARSE}.enabled", ["1 (int)", "must be true or false"]),
    (sparse(keep_device_kv_cache="false"), f"{SPARSE}.keep_device_kv_cache", ["must be true or false"]),
    (sparse(miss_prefetch="on"), f"{SPARSE}.miss_prefetch", ["'on' (str)", "must be true or false"]),
    (sparse(hot_cache_policy="lfu"), f"{SPARSE}.hot_cache_policy", ["'lfu' (str)", "must be one of 'lru', 'slru'"]),
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
# warnings


def test_unknown_key_warning_suggests_and_logs_once() -> None:
    raw = with_extra(STORE, layerwise_num_shared_buffer=4)
    with capture_logs() as logs:
        config = parse_kv_transfer_config(raw)
    assert len(config.warnings) == 1
    warning = config.warnings[0]
    assert warning.startswith("kv_connector_extra_config: unknown key 'layerwise_num_shared_buffer' (ignored)")
    assert "did you mean 'layerwise_num_shared_buffers'?" in warning
    assert "known keys: backend, use_layerwise, layerwise_num_shared_buffers" in warning
    assert [(e["event"], e["log_level"]) for e in logs] == [("unknown_config_keys", "warning")]
    assert logs[0]["warnings"] == config.warnings
    assert logs[0]["option"] == "--kv-transfer-config"
    assert config.store is not None and config.store.layerwise_num_shared_buffers == 3  # typo ignored, not applied


def test_unknown_key_without_close_match_has_no_suggestion() -> None:
    config = parse_kv_transfer_config(with_top(STORE, zzz=1))
    assert config.warnings == [
        "kv_transfer_config: unknown key 'zzz' (ignored); known keys: kv_connector, kv_role, kv_port, "
        "kv_connector_extra_config"
    ]


def test_vllm_transfer_keys_are_accepted_silently() -> None:
    raw = with_top(D2H, kv_ip="10.0.0.1", kv_rank=0, kv_parallel_size=2, engine_id="e", kv_buffer_device="npu")
    assert parse_kv_transfer_config(raw).warnings == []


def test_nested_warning_paths() -> None:
    raw = with_extra(MULTI, connectors=[with_top(decode_d2h(), kv_role="kv_producer", kv_prot=1), prefill_only()])
    raw["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]["bakend"] = "memcache"
    config = parse_kv_transfer_config(raw)
    assert len(config.warnings) == 2
    first, second = config.warnings
    assert first.startswith("kv_connector_extra_config.connectors[0]: unknown key 'kv_prot'")
    assert "did you mean 'kv_port'?" in first
    assert second.startswith("kv_connector_extra_config.connectors[1].kv_connector_extra_config: unknown key 'bakend'")
    assert "did you mean 'backend'?" in second


def test_layerwise_keys_without_use_layerwise_warn() -> None:
    raw = with_extra(STORE, use_layerwise=False, layerwise_prefetch_layers=2)
    with capture_logs() as logs:
        config = parse_kv_transfer_config(raw)
    assert sorted(config.warnings) == sorted(
        f"kv_connector_extra_config.{key}: has no effect while use_layerwise is false (set use_layerwise: true to use it)"
        for key in ("layerwise_num_shared_buffers", "layerwise_independent_layers", "layerwise_prefetch_layers")
    )
    assert [e["event"] for e in logs] == ["ineffective_config_keys"]


def test_additional_config_typo_of_sparse_key_warns() -> None:
    config = parse_additional_config({"sparse_kv_ofload_config": {"enabled": True}, "xlite_graph_config": {}})
    assert config.warnings == [
        "additional_config: unknown key 'sparse_kv_ofload_config' (ignored); did you mean 'sparse_kv_offload_config'?"
    ]
    assert config.sparse_kv_offload_config.enabled is False


def test_unknown_key_inside_sparse_config_warns() -> None:
    config = parse_additional_config(sparse(enabled=True, topk_buffer=2048))
    assert len(config.warnings) == 1
    assert config.warnings[0].startswith("sparse_kv_offload_config: unknown key 'topk_buffer' (ignored)")
    assert "did you mean 'topk_buffer_size'?" in config.warnings[0]


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


@pytest.mark.parametrize("extra,message", [
    ({"metastore": "nohostport"}, 'kv_connector_extra_config.metastore: got \'nohostport\' (str); must be "HOST:PORT"'),
    ({"metastore": "h:70000"}, "kv_connector_extra_config.metastore: got 'h:70000'"),
    ({"host_pool_gb": 0}, "kv_connector_extra_config.host_pool_gb: got 0 (int); must be a number of GiB > 0"),
    ({"host_pool_gb": "1GB"}, "kv_connector_extra_config.host_pool_gb: got '1GB' (str)"),
])
def test_store_pool_keys_are_checked(extra, message):
    with pytest.raises(ConfigError) as e:
        parse_kv_transfer_config({"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"backend": "kvoffload", **extra}})
    assert message in str(e.value)


def test_strict_parsing_makes_an_unknown_key_an_error_with_a_suggestion():
    body = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"backend": "kvoffload", "metastor": "a:1"}}
    assert parse_kv_transfer_config(body).store.metastore is None  # not strict: a warning only
    with pytest.raises(ConfigError) as e:
        parse_kv_transfer_config(body, strict=True)
    assert "kv_connector_extra_config: unknown key 'metastor'; did you mean 'metastore'?" in str(e.value)


def test_the_vllm_d2h_keys_are_typed_and_named_for_the_services_that_take_flags_instead():
    cfg = parse_kv_transfer_config({"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer", "kv_port": 20050,
                                    "kv_connector_extra_config": {"advertise_host": "10.0.0.7", "data_port": 0,
                                                                  "peer_timeout_s": 3}}, strict=True)
    extra = cfg.kv_connector_extra_config
    assert (extra.advertise_host, extra.data_port, extra.peer_timeout_s) == ("10.0.0.7", 0, 3.0)
    assert extra.vllm_only_problems() == [
        "kv_connector_extra_config.advertise_host: read by the vLLM connector only; the kvoffload services take "
        "--advertise-host instead",
        "kv_connector_extra_config.data_port: read by the vLLM connector only; the kvoffload services take "
        "--data-port instead",
        "kv_connector_extra_config.peer_timeout_s: read by the vLLM connector only; the kvoffload services take "
        "--peer-timeout-s instead"]
    for key, bad, rule in (("advertise_host", "0.0.0.0", "not a wildcard"), ("advertise_host", "h:80", "without a port"),
                           ("data_port", 70000, "in 0..65535"), ("peer_timeout_s", 0, "seconds > 0")):
        with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}: got .*{rule}"):
            parse_kv_transfer_config({"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer",
                                      "kv_connector_extra_config": {key: bad}}, strict=True)


# ------------------------------------------------------------------------------------------------
# backend "mooncake": its keys, required with it and refused with the others

MOONCAKE = "127.0.0.1:50051"


def store_extra(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra}


@pytest.mark.parametrize("inside_multi", [False, True], ids=["alone", "multi"])
def test_mooncake_backend_with_its_master(inside_multi: bool) -> None:
    base = prefill_multi(backend="mooncake", transfer_backend="kvoffload") if inside_multi else prefill_only("mooncake")
    raw = copy.deepcopy(base)
    extra = (raw["kv_connector_extra_config"]["connectors"][1] if inside_multi else raw)["kv_connector_extra_config"]
    extra.update(mooncake_master=MOONCAKE, host_pool_gb=0.5)
    store = parse_kv_transfer_config(json.dumps(raw), strict=True).store
    assert store is not None and store.backend == "mooncake"
    assert store.mooncake_master == MOONCAKE
    assert (store.mooncake_namespace, store.mooncake_lease_ttl_ms) == ("kvoffload", 5000)
    assert store.host_pool_gb == 0.5 and store.metastore is None
    extra.update(mooncake_namespace="team-a", mooncake_lease_ttl_ms=30_000)
    store = parse_kv_transfer_config(raw).store
    assert (store.mooncake_namespace, store.mooncake_lease_ttl_ms) == ("team-a", 30_000)


@pytest.mark.parametrize(("extra", "expected"), [
    ({"backend": "mooncake"},
     ["kv_connector_extra_config.mooncake_master: required with backend 'mooncake'; must be \"HOST:PORT\" (the "
      "mooncake_master's RPC address, e.g. \"127.0.0.1:50051\")"]),
    ({"backend": "mooncake", "mooncake_master": None}, ["kv_connector_extra_config.mooncake_master: required with"]),
    ({"backend": "mooncake", "mooncake_master": MOONCAKE, "metastore": "127.0.0.1:5000"},
     ["kv_connector_extra_config.metastore: applies to backend 'kvoffload' only (the kvoffload-metastore that "
      "indexes the embedded pool; the mooncake backend keeps its index in the mooncake_master), not 'mooncake'; "
      "remove it"]),
    ({"backend": "kvoffload", "mooncake_master": MOONCAKE},
     ["kv_connector_extra_config.mooncake_master: applies to backend 'mooncake' only (the mooncake backend's "
      "master), not 'kvoffload'; remove it"]),
    ({"backend": "memcache", "mooncake_namespace": "a"},
     ["kv_connector_extra_config.mooncake_namespace: applies to backend 'mooncake' only (the mooncake backend's key "
      "namespace), not 'memcache'; remove it"]),
    ({"backend": "kvoffload", "mooncake_lease_ttl_ms": 5000},
     ["kv_connector_extra_config.mooncake_lease_ttl_ms: applies to backend 'mooncake' only"]),
    ({"backend": "mooncake", "mooncake_master": "50051"},
     ["kv_connector_extra_config.mooncake_master: got '50051' (str); must be \"HOST:PORT\" (the mooncake_master's "
      "RPC address)"]),
    ({"backend": "mooncake", "mooncake_master": "h:0"}, ["kv_connector_extra_config.mooncake_master: got 'h:0' (str)"]),
    ({"backend": "mooncake", "mooncake_master": MOONCAKE, "mooncake_namespace": "a/b"},
     ["kv_connector_extra_config.mooncake_namespace: got 'a/b' (str); must be a non-empty string without '/' or "
      "surrounding spaces"]),
    ({"backend": "mooncake", "mooncake_master": MOONCAKE, "mooncake_namespace": ""},
     ["kv_connector_extra_config.mooncake_namespace: got '' (str)"]),
    ({"backend": "mooncake", "mooncake_master": MOONCAKE, "mooncake_lease_ttl_ms": 0},
     ["kv_connector_extra_config.mooncake_lease_ttl_ms: got 0 (int); must be an int >= 1"]),
    ({"backend": "mooncake", "mooncake_master": MOONCAKE, "mooncake_lease_ttl_ms": "5s"},
     ["kv_connector_extra_config.mooncake_lease_ttl_ms: got '5s' (str); must be an int >= 1"]),
    ({"backend": "mooncake", "metastore": "127.0.0.1:5000", "mooncake_lease_ttl_ms": 0},  # every problem at once
     ["kv_connector_extra_config.mooncake_lease_ttl_ms: got 0", "kv_connector_extra_config.mooncake_master: required",
      "kv_connector_extra_config.metastore: applies to backend 'kvoffload' only"]),
])
def test_mooncake_rules(extra: dict[str, Any], expected: list[str]) -> None:
    errors = errors_of(parse_kv_transfer_config, store_extra(**extra))
    assert len(errors) == len(expected), errors
    for want in expected:
        assert any(e.startswith(want) for e in errors), (want, errors)


def test_mooncake_rules_name_the_field_inside_a_multi_connector() -> None:
    raw = prefill_multi(backend="mooncake", transfer_backend="kvoffload")
    raw["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]["metastore"] = "127.0.0.1:5000"
    errors = errors_of(parse_kv_transfer_config, raw)
    prefix = "kv_connector_extra_config.connectors[1].kv_connector_extra_config."
    assert [e.split(":")[0] for e in errors] == [f"{prefix}mooncake_master", f"{prefix}metastore"], errors


def test_the_other_backends_are_unchanged_by_the_mooncake_keys() -> None:
    """A memcache config may still carry metastore (as before); kvoffload's keys keep their meaning."""
    assert parse_kv_transfer_config(store_extra(backend="memcache", metastore="h:1")).store.metastore == "h:1"
    store = parse_kv_transfer_config(store_extra(backend="kvoffload", metastore="h:1", host_pool_gb=2)).store
    assert (store.metastore, store.host_pool_gb, store.mooncake_master) == ("h:1", 2.0, None)


# ---- transfer_backend "memfabric": its TransferEngine's device and data operation ----------------


def test_memfabric_keys_default_and_set() -> None:
    plain = parse_kv_transfer_config(decode_d2h("memfabric")).kv_connector_extra_config
    assert (plain.memfabric_device_id, plain.memfabric_data_op) == (0, "sdma")
    config = parse_kv_transfer_config(with_extra(decode_d2h("memfabric"), memfabric_device_id=3,
                                                 memfabric_data_op="host_rdma"))
    extra = config.kv_connector_extra_config
    assert (extra.memfabric_device_id, extra.memfabric_data_op) == (3, "host_rdma")
    assert config.warnings == []


@pytest.mark.parametrize(("extra", "expected"), [
    ({"memfabric_device_id": 1},
     f"{EXTRA}.memfabric_device_id: applies to transfer_backend 'memfabric' only (the Ascend NPU memfabric's "
     "TransferEngine binds; default 0), not 'kvoffload'; remove it"),
    ({"memfabric_data_op": "sdma"},
     f"{EXTRA}.memfabric_data_op: applies to transfer_backend 'memfabric' only (memfabric's data operation; default "
     "'sdma'), not 'kvoffload'; remove it"),
])
def test_memfabric_keys_are_refused_with_the_embedded_transfer_backend(extra: dict[str, Any], expected: str) -> None:
    assert errors_of(parse_kv_transfer_config, with_extra(decode_d2h("kvoffload"), **extra)) == [expected]


def test_memfabric_keys_inside_a_multi_connector_name_the_field() -> None:
    raw = prefill_multi("kvoffload", "kvoffload")
    raw["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]["memfabric_device_id"] = 0
    assert errors_of(parse_kv_transfer_config, raw)[0].startswith(
        f"{EXTRA}.connectors[0].{EXTRA}.memfabric_device_id: applies to transfer_backend 'memfabric' only")


@pytest.mark.parametrize(("extra", "path", "words"), [
    ({"memfabric_device_id": -1}, "memfabric_device_id", ["got -1 (int); must be an int >= 0"]),
    ({"memfabric_device_id": True}, "memfabric_device_id", ["got True (bool)"]),
    ({"memfabric_device_id": "0"}, "memfabric_device_id", ["got '0' (str)"]),
    ({"memfabric_data_op": "rdma"}, "memfabric_data_op", ["'rdma' (str)", "'sdma', 'host_rdma', 'device_rdma'",
                                                          "did you mean"]),
    ({"memfabric_data_op": "host-rdma"}, "memfabric_data_op", ["'host-rdma' (str)", "did you mean 'host_rdma'?"]),
])
def test_memfabric_key_values(extra: dict[str, Any], path: str, words: list[str]) -> None:
    errors = errors_of(parse_kv_transfer_config, with_extra(decode_d2h("memfabric"), **extra))
    assert len(errors) == 1 and errors[0].startswith(f"{EXTRA}.{path}: "), errors
    for word in words:
        assert word in errors[0], (word, errors)
