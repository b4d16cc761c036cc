"""Parsing of --kv-transfer-config / --additional-config: the guide's examples, defaults, malformed
JSON, and the warnings (unknown keys, keys without effect) kept on the parsed object and logged."""

from __future__ import annotations

import json
from typing import Any

import pytest
from config_support import (
    D2H,
    GUIDE_ADDITIONAL,
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
)
from pydantic import ValidationError
from structlog.testing import capture_logs

from kvcore.config.additional import SparseKVOffloadConfig
from kvcore.config.connectors import D2HConnectorConfig, StoreConnectorConfig
from kvcore.config.errors import ConfigError
from kvcore.config.kv_transfer import MultiConnectorConfig
from kvcore.config.parse import parse_additional_config, parse_kv_transfer_config

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
        {
            "kv_connector": "AscendStoreConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"backend": "kvoffload"},
        }
    )
    assert config.is_producer and config.is_consumer
    assert config.store is not None and config.store.model_dump() == {
        "backend": "kvoffload",
        "use_layerwise": False,
        "layerwise_num_shared_buffers": None,
        "layerwise_independent_layers": (0,),
        "layerwise_prefetch_layers": None,
        "layerwise_request_kv_gb": None,
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
    assert sparse.hot_cache_policy == "clock"
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
# malformed input


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
        f"kv_connector_extra_config.{key}: has no effect while use_layerwise is false "
        "(set use_layerwise: true to use it)"
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


def test_strict_parsing_makes_an_unknown_key_an_error_with_a_suggestion():
    body = {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "kvoffload", "metastor": "a:1"},
    }
    assert parse_kv_transfer_config(body).store.metastore is None  # not strict: a warning only
    with pytest.raises(ConfigError) as e:
        parse_kv_transfer_config(body, strict=True)
    assert "kv_connector_extra_config: unknown key 'metastor'; did you mean 'metastore'?" in str(e.value)
