"""Prefill node settings: independent layers with MTP, buffer defaults, and every prefill rule."""

from __future__ import annotations

import json
from typing import Any

import pytest
from settings_support import (
    EXTRA,
    LAYOUT,
    NUM_LAYERS,
    SPARSE,
    additional,
    assert_error,
    d2h,
    prefill_errors,
    prefill_multi,
    store,
)

from kvcore.config.connectors import D2HConnectorConfig
from kvcore.config.errors import ConfigError
from kvcore.config.parse import parse_additional_config, parse_kv_transfer_config
from kvcore.config.prefill_settings import PrefillSettings, prefill_settings, resolve_independent_layers
from kvcore.layout import KVLayout

# ------------------------------------------------------------------------------------------------
# independent layers


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ([0], {0}),
        ("all", {0, 1, 2, 3, 4}),
        ([-1], {4}),  # -1 = the last MTP layer
        ([-5], {0}),
        ([4], {4}),
        ([0, 0, -5], {0}),
        ([1, -2], {1, 3}),
        ([], set()),
        ((2,), {2}),
    ],
)
def test_resolve_independent_layers(spec: Any, expected: set[int]) -> None:
    assert resolve_independent_layers(spec, LAYOUT.num_layers) == frozenset(expected)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ([5], ["got 5", "[-5, 4]"]),
        ([-6], ["got -6", "[-5, 4]"]),
        ("0", ['must be "all" or a list of ints']),
        ([0, True], ['must be "all" or a list of ints']),
        (3, ['must be "all" or a list of ints']),
    ],
)
def test_resolve_independent_layers_errors(spec: Any, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_independent_layers(spec, NUM_LAYERS)
    assert_error(info.value.errors, "layerwise_independent_layers", words)


def test_resolve_independent_layers_reports_every_bad_value() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_independent_layers([7, 0, -9], NUM_LAYERS)
    assert [e.split(";")[0] for e in info.value.errors] == [
        "layerwise_independent_layers: got 7",
        "layerwise_independent_layers: got -9",
    ]


# ------------------------------------------------------------------------------------------------
# prefill


@pytest.mark.parametrize("backend", ["memcache", "kvoffload"])
def test_guide_prefill_only(backend: str) -> None:
    settings = prefill_settings(store(backend), None, LAYOUT)
    assert isinstance(settings, PrefillSettings)
    assert settings.store.backend == backend
    assert (settings.num_shared_buffers, settings.independent_layers, settings.prefetch_layers) == (3, {0}, 3)
    assert settings.d2h is None and settings.tp == 1 and settings.warnings == []


@pytest.mark.parametrize(("backend", "transfer"), [("memcache", "memfabric"), ("kvoffload", "kvoffload")])
def test_guide_prefill_multi(backend: str, transfer: str) -> None:
    settings = prefill_settings(prefill_multi(backend, transfer), "{}", LAYOUT, tp=4)
    assert settings.d2h == D2HConnectorConfig(transfer_backend=transfer, use_layerwise=True)
    assert settings.store.backend == backend
    assert settings.tp == 4


def test_prefill_accepts_parsed_configs_and_json() -> None:
    parsed = prefill_settings(parse_kv_transfer_config(store()), parse_additional_config(None), LAYOUT)
    as_json = prefill_settings(json.dumps(store()), json.dumps({}), LAYOUT)
    assert parsed == as_json


@pytest.mark.parametrize(
    ("extra", "layout", "buffers", "independent", "prefetch"),
    [
        # defaults: B = number of layers (MTP included), prefetch = min(B, 8)
        ({"layerwise_num_shared_buffers": None}, LAYOUT, 5, {0}, 5),
        (
            {"layerwise_num_shared_buffers": None},
            KVLayout.for_mla(num_hidden_layers=11, kv_lora_rank=8, qk_rope_head_dim=8, block_size=16, num_mtp_layers=1),
            12,
            {0},
            8,
        ),
        ({"layerwise_num_shared_buffers": 10}, LAYOUT, 10, {0}, 8),
        ({"layerwise_prefetch_layers": 2}, LAYOUT, 3, {0}, 2),
        ({"layerwise_independent_layers": "all"}, LAYOUT, 3, {0, 1, 2, 3, 4}, 3),
        ({"layerwise_independent_layers": [0, -1]}, LAYOUT, 3, {0, 4}, 3),
        ({"use_layerwise": False, "layerwise_num_shared_buffers": None}, LAYOUT, 5, {0}, 5),
    ],
)
def test_prefill_buffer_defaults(
    extra: dict[str, Any], layout: KVLayout, buffers: int, independent: set[int], prefetch: int
) -> None:
    settings = prefill_settings(store(**extra), None, layout)
    assert settings.num_shared_buffers == buffers
    assert settings.independent_layers == frozenset(independent)
    assert settings.prefetch_layers == prefetch


STORE_IN_MULTI = f"{EXTRA}.connectors[1].{EXTRA}"

INVALID_PREFILL = [
    (store(role="kv_consumer"), None, {}, "kv_role", ["'kv_consumer'", "'kv_producer'"]),
    (d2h(role="kv_producer"), None, {}, "kv_connector", ["'SfaRemoteD2HConnector'", "AscendStoreConnector"]),
    (
        store(use_layerwise=False),
        None,
        {},
        f"{EXTRA}.layerwise_num_shared_buffers",
        ["got 3 while use_layerwise is false", "use_layerwise: true"],
    ),
    (
        prefill_multi(use_layerwise=False),
        None,
        {},
        f"{STORE_IN_MULTI}.layerwise_num_shared_buffers",
        ["use_layerwise is false"],
    ),
    (store(), additional(enabled=True), {}, f"{SPARSE}.enabled", ["never enable sparse_kv_offload_config on prefill"]),
    (
        prefill_multi(transfer_backend=None),
        None,
        {},
        f"{EXTRA}.connectors[0].{EXTRA}.transfer_backend",
        ["required", "'kvoffload'", "'memfabric'"],
    ),
    (store(), None, {"tp": 0}, "tp", ["got 0 (int)", "must be an int >= 1"]),
    (store(), None, {"tp": True}, "tp", ["True (bool)"]),
    (store(layerwise_independent_layers=[5]), None, {}, f"{EXTRA}.layerwise_independent_layers", ["got 5", "[-5, 4]"]),
    (
        prefill_multi(layerwise_independent_layers=[-6]),
        None,
        {},
        f"{STORE_IN_MULTI}.layerwise_independent_layers",
        ["got -6", "[-5, 4]"],
    ),
]


@pytest.mark.parametrize(("kv", "add", "kw", "path", "words"), INVALID_PREFILL)
def test_invalid_prefill(kv: Any, add: Any, kw: dict[str, Any], path: str, words: list[str]) -> None:
    assert_error(prefill_errors(kv, add, **kw), path, words)


def test_prefill_lists_every_problem() -> None:
    kv = store(role="kv_consumer", use_layerwise=False, layerwise_independent_layers=[9])
    errors = prefill_errors(kv, additional(enabled=True), tp=0)
    assert sorted(e.split(": ")[0] for e in errors) == sorted(
        [
            "kv_role",
            f"{SPARSE}.enabled",
            "tp",
            f"{EXTRA}.layerwise_num_shared_buffers",
            f"{EXTRA}.layerwise_independent_layers",
        ]
    )


def test_prefill_combines_parse_errors_of_both_configs() -> None:
    errors = prefill_errors(store(backend="x"), '{"sparse_kv_offload_config": {"dram_size_per_dp_GB": "10GB"}}')
    assert [e.split(": ")[0] for e in errors] == [f"{EXTRA}.backend", f"{SPARSE}.dram_size_per_dp_GB"]


def test_prefill_sparse_allowed_with_keep_device_kv_cache_and_warns() -> None:
    settings = prefill_settings(store(), additional(enabled=True, keep_device_kv_cache=True), LAYOUT)
    assert any("keep_device_kv_cache" in w and "debug" in w for w in settings.warnings)


def test_prefill_carries_config_warnings() -> None:
    settings = prefill_settings(store(layerwise_num_shared_buffer=2), {"sparse_kv_offlaod_config": {}}, LAYOUT)
    assert len(settings.warnings) == 2
    assert "did you mean 'layerwise_num_shared_buffers'?" in settings.warnings[0]
    assert "did you mean 'sparse_kv_offload_config'?" in settings.warnings[1]


def test_prefill_warns_that_the_vllm_host_copies_budget_has_no_effect_here() -> None:
    settings = prefill_settings(store(layerwise_request_kv_gb=2), None, LAYOUT)
    assert settings.warnings == [
        f"{EXTRA}.layerwise_request_kv_gb: has no effect on the reference prefill (vLLM's store connector bounds "
        "its host copies with it; here earlier chunks live in the host pool, host_pool_gb)"
    ]
