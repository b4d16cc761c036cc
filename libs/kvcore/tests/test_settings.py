"""Per-node settings: prefill/decode rules, independent layers with MTP, ports, sizing, P/D pairs."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.config import ConfigError, D2HConnectorConfig, parse_additional_config, parse_kv_transfer_config
from kvcore.layout import KVLayout
from kvcore.settings import (
    DecodeSettings,
    PrefillSettings,
    check_pd_pair,
    decode_settings,
    prefill_settings,
    resolve_independent_layers,
)

# 4 base layers + 1 MTP layer = 5 physical layers; latent 512 + rope 64 in bf16 = 1152 bytes per layer
# and token; indexer keys are not part of the host pool.
KV_LORA_RANK, ROPE_DIM, BLOCK = 512, 64, 64
LAYOUT = KVLayout.for_mla(
    num_hidden_layers=4, kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM, block_size=BLOCK,
    num_mtp_layers=1, index_head_dim=128,
)
NUM_LAYERS = 5
MAIN_BYTES_PER_TOKEN = NUM_LAYERS * (KV_LORA_RANK + ROPE_DIM) * 2
EXTRA = "kv_connector_extra_config"
SPARSE = "sparse_kv_offload_config"


def store(backend: str = "memcache", role: str = "kv_producer", **extra: Any) -> dict[str, Any]:
    config = {"backend": backend, "use_layerwise": True, "layerwise_num_shared_buffers": 3,
              "layerwise_independent_layers": [0]}
    config.update(extra)
    return {"kv_connector": "AscendStoreConnector", "kv_role": role, EXTRA: {k: v for k, v in config.items() if v is not None}}


def d2h(transfer_backend: str | None = "memfabric", role: str = "kv_consumer", kv_port: int | None = 20050) -> dict[str, Any]:
    out: dict[str, Any] = {"kv_connector": "SfaRemoteD2HConnector", "kv_role": role, EXTRA: {"use_layerwise": True}}
    if transfer_backend is not None:
        out[EXTRA]["transfer_backend"] = transfer_backend
    if kv_port is not None:
        out["kv_port"] = kv_port
    return out


def multi(*children: dict[str, Any], role: str = "kv_producer") -> dict[str, Any]:
    return {"kv_connector": "MultiConnector", "kv_role": role, EXTRA: {"connectors": list(children)}}


def prefill_multi(backend: str = "memcache", transfer_backend: str | None = "memfabric", **extra: Any) -> dict[str, Any]:
    return multi(d2h(transfer_backend, role="kv_producer"), store(backend, **extra))


def additional(**sparse: Any) -> dict[str, Any]:
    return {SPARSE: sparse}


DECODE_SPARSE = additional(enabled=True, topk_buffer_size=4096, dram_size_per_dp_GB=128)
DECODE_KW: dict[str, Any] = {"index_topk": 2048, "max_num_seqs": 4, "max_model_len": 1000}


def prefill_errors(kv: Any, add: Any = None, layout: KVLayout = LAYOUT, **kw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        prefill_settings(kv, add, layout, **kw)
    return info.value.errors


def decode_errors(kv: Any, add: Any, **kw: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        decode_settings(kv, add, LAYOUT, **{**DECODE_KW, **kw})
    return info.value.errors


def assert_error(errors: list[str], path: str, words: list[str]) -> None:
    matching = [e for e in errors if e.startswith(f"{path}: ")]
    assert matching, errors
    for word in words:
        assert any(word in e for e in matching), (word, matching)


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
        ({"layerwise_num_shared_buffers": None},
         KVLayout.for_mla(num_hidden_layers=11, kv_lora_rank=8, qk_rope_head_dim=8, block_size=16, num_mtp_layers=1),
         12, {0}, 8),
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
    (store(use_layerwise=False), None, {}, f"{EXTRA}.layerwise_num_shared_buffers",
     ["got 3 while use_layerwise is false", "use_layerwise: true"]),
    (prefill_multi(use_layerwise=False), None, {}, f"{STORE_IN_MULTI}.layerwise_num_shared_buffers",
     ["use_layerwise is false"]),
    (store(), additional(enabled=True), {}, f"{SPARSE}.enabled", ["never enable sparse_kv_offload_config on prefill"]),
    (prefill_multi(transfer_backend=None), None, {}, f"{EXTRA}.connectors[0].{EXTRA}.transfer_backend",
     ["required", "'kvoffload'", "'memfabric'"]),
    (store(), None, {"tp": 0}, "tp", ["got 0 (int)", "must be an int >= 1"]),
    (store(), None, {"tp": True}, "tp", ["True (bool)"]),
    (store(layerwise_independent_layers=[5]), None, {}, f"{EXTRA}.layerwise_independent_layers", ["got 5", "[-5, 4]"]),
    (prefill_multi(layerwise_independent_layers=[-6]), None, {}, f"{STORE_IN_MULTI}.layerwise_independent_layers",
     ["got -6", "[-5, 4]"]),
]


@pytest.mark.parametrize(("kv", "add", "kw", "path", "words"), INVALID_PREFILL)
def test_invalid_prefill(kv: Any, add: Any, kw: dict[str, Any], path: str, words: list[str]) -> None:
    assert_error(prefill_errors(kv, add, **kw), path, words)


def test_prefill_lists_every_problem() -> None:
    kv = store(role="kv_consumer", use_layerwise=False, layerwise_independent_layers=[9])
    errors = prefill_errors(kv, additional(enabled=True), tp=0)
    assert sorted(e.split(": ")[0] for e in errors) == sorted(
        ["kv_role", f"{SPARSE}.enabled", "tp", f"{EXTRA}.layerwise_num_shared_buffers", f"{EXTRA}.layerwise_independent_layers"]
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


# ------------------------------------------------------------------------------------------------
# decode


@pytest.mark.parametrize("transfer", ["memfabric", "kvoffload"])
def test_guide_decode(transfer: str) -> None:
    settings = decode_settings(d2h(transfer), DECODE_SPARSE, LAYOUT, **DECODE_KW)
    assert isinstance(settings, DecodeSettings)
    assert settings.d2h == D2HConnectorConfig(transfer_backend=transfer, use_layerwise=True)
    assert settings.kv_port == 20050 and (settings.dp, settings.tp) == (1, 1)
    assert settings.sparse.enabled and settings.sparse.topk_buffer_size == 4096
    assert settings.host_pool_bytes == 128 * 1024**3
    assert settings.control_ports() == [20050]


def test_decode_d2h_inside_multi_connector() -> None:
    kv = multi(d2h("kvoffload", kv_port=30000), store("kvoffload", role="kv_consumer"), role="kv_consumer")
    settings = decode_settings(kv, DECODE_SPARSE, LAYOUT, **DECODE_KW)
    assert settings.kv_port == 30000 and settings.d2h.transfer_backend == "kvoffload"


def test_host_bytes_needed_from_first_principles() -> None:
    seqs, length = 3, 1000
    blocks = -(-length // BLOCK)  # 16 blocks of 64 tokens
    expected = seqs * blocks * BLOCK * NUM_LAYERS * (KV_LORA_RANK + ROPE_DIM) * 2
    assert expected == 3 * 1024 * 5760
    settings = decode_settings(d2h(), DECODE_SPARSE, LAYOUT, index_topk=2048, max_num_seqs=seqs, max_model_len=length)
    assert settings.host_bytes_needed == expected


def test_host_pool_too_small_gives_numbers() -> None:
    seqs, length = 8, 100_000
    tokens = -(-length // BLOCK) * BLOCK  # 100032
    needed = seqs * tokens * MAIN_BYTES_PER_TOKEN  # 4609474560 bytes, a bit over 4 GiB
    gib = -(-needed // 2**30)
    assert (tokens, needed, gib) == (100032, 4609474560, 5)
    errors = decode_errors(d2h(), additional(enabled=True, dram_size_per_dp_GB=4), max_num_seqs=seqs, max_model_len=length)
    assert_error(errors, f"{SPARSE}.dram_size_per_dp_GB", [f"got 4 ({4 * 2**30} bytes)", f"{needed} bytes", f">= {gib}"])
    exact = decode_settings(d2h(), additional(enabled=True, dram_size_per_dp_GB=gib), LAYOUT,
                            index_topk=2048, max_num_seqs=seqs, max_model_len=length)
    assert exact.host_bytes_needed == needed and exact.host_pool_bytes == gib * 2**30


def test_control_ports() -> None:
    settings = decode_settings(d2h(kv_port=20050), DECODE_SPARSE, LAYOUT, **DECODE_KW, dp=2, tp=4)
    assert settings.control_port(0, 0) == 20050
    assert settings.control_port(1, 2) == 20050 + 1 * 4 + 2
    assert settings.control_ports() == list(range(20050, 20058))


@pytest.mark.parametrize(("dp_rank", "tp_rank", "word"), [(2, 0, "dp_rank"), (-1, 0, "dp_rank"), (0, 4, "tp_rank"),
                                                          (0, -1, "tp_rank"), (True, 0, "dp_rank"), (0, 1.0, "tp_rank")])
def test_control_port_rejects_bad_ranks(dp_rank: Any, tp_rank: Any, word: str) -> None:
    settings = decode_settings(d2h(), DECODE_SPARSE, LAYOUT, **DECODE_KW, dp=2, tp=4)
    with pytest.raises(ValueError, match=word):
        settings.control_port(dp_rank, tp_rank)


def test_last_control_port_boundary() -> None:
    ok = decode_settings(d2h(kv_port=65535 - 8 + 1), DECODE_SPARSE, LAYOUT, **DECODE_KW, dp=2, tp=4)
    assert ok.control_ports()[-1] == 65535
    errors = decode_errors(d2h(kv_port=65530), DECODE_SPARSE, dp=2, tp=4)
    assert_error(errors, "kv_port", ["got 65530", "dp=2 x tp=4 = 8", "65530..65537", "<= 65535", "kv_port <= 65528"])


D2H_IN_MULTI = f"{EXTRA}.connectors[0]."

INVALID_DECODE = [
    (d2h(role="kv_producer"), DECODE_SPARSE, {}, "kv_role", ["'kv_producer'", "'kv_consumer'"]),
    (store(role="kv_consumer"), DECODE_SPARSE, {}, "kv_connector", ["'AscendStoreConnector'", "SfaRemoteD2HConnector"]),
    (d2h(kv_port=None), DECODE_SPARSE, {}, "kv_port", ["required"]),
    (multi(d2h(kv_port=None), role="kv_consumer"), DECODE_SPARSE, {}, f"{D2H_IN_MULTI}kv_port", ["required"]),
    (d2h(transfer_backend=None), DECODE_SPARSE, {}, f"{EXTRA}.transfer_backend", ["required", "'memfabric'"]),
    (multi(d2h(None), role="kv_consumer"), DECODE_SPARSE, {}, f"{D2H_IN_MULTI}{EXTRA}.transfer_backend", ["required"]),
    (d2h(), None, {}, f"{SPARSE}.enabled", ["got False", "kv_consumer", "must be true"]),
    (d2h(), additional(enabled=True), {"index_topk": None}, f"{SPARSE}.enabled", ["no indexer", "index_topk is None"]),
    (d2h(), additional(enabled=True), {"index_topk": 0}, "index_topk", ["got 0 (int)"]),
    (d2h(), additional(enabled=True, topk_buffer_size=1024), {"index_topk": 2048}, f"{SPARSE}.topk_buffer_size",
     ["got 1024", ">= index_topk 2048"]),
    (d2h(), additional(enabled=True, topk_buffer_size=4000), {"index_topk": 2048}, f"{SPARSE}.topk_buffer_size",
     ["got 4000", "divisible by block_size 64", "4000 % 64 = 32"]),
    (d2h(), DECODE_SPARSE, {"max_num_seqs": 0}, "max_num_seqs", ["got 0 (int)", ">= 1"]),
    (d2h(), DECODE_SPARSE, {"max_model_len": -1}, "max_model_len", ["got -1 (int)"]),
    (d2h(), DECODE_SPARSE, {"dp": 0}, "dp", ["got 0 (int)"]),
    (d2h(), DECODE_SPARSE, {"tp": True}, "tp", ["True (bool)"]),
    (d2h(), '{"sparse_kv_offload_config": {"enabled": "yes"}}', {}, f"{SPARSE}.enabled", ["'yes' (str)"]),
]


@pytest.mark.parametrize(("kv", "add", "kw", "path", "words"), INVALID_DECODE)
def test_invalid_decode(kv: Any, add: Any, kw: dict[str, Any], path: str, words: list[str]) -> None:
    assert_error(decode_errors(kv, add, **kw), path, words)


def test_decode_both_topk_errors_at_once() -> None:
    errors = decode_errors(d2h(), additional(enabled=True, topk_buffer_size=1000), index_topk=2048)
    assert [e.split(":")[0] for e in errors] == [f"{SPARSE}.topk_buffer_size"] * 2


def test_decode_keep_device_kv_cache_without_sparse() -> None:
    settings = decode_settings(d2h(), additional(keep_device_kv_cache=True), LAYOUT, **{**DECODE_KW, "index_topk": None})
    assert not settings.sparse.enabled
    assert any("keep_device_kv_cache" in w for w in settings.warnings)


def test_decode_kv_both_is_a_consumer() -> None:
    assert decode_settings(d2h(role="kv_both"), DECODE_SPARSE, LAYOUT, **DECODE_KW).kv_port == 20050


# ------------------------------------------------------------------------------------------------
# P/D pairs


def pair(p_kv: Any, d_kv: Any, p_tp: int, d_tp: int) -> tuple[PrefillSettings, DecodeSettings]:
    return (
        prefill_settings(p_kv, None, LAYOUT, tp=p_tp),
        decode_settings(d_kv, DECODE_SPARSE, LAYOUT, **DECODE_KW, tp=d_tp),
    )


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (4, 2), (8, 1), (4, 4)])
def test_pd_pair_ok(p_tp: int, d_tp: int) -> None:
    check_pd_pair(*pair(prefill_multi(), d2h(), p_tp, d_tp))
    check_pd_pair(*pair(prefill_multi("kvoffload", "kvoffload"), d2h("kvoffload"), p_tp, d_tp))


@pytest.mark.parametrize(
    ("p_kv", "d_kv", "p_tp", "d_tp", "words"),
    [
        (prefill_multi(), d2h(), 2, 4, ["tp", "prefill tp 2", "decode tp 4", ">= decode TP and divisible"]),
        (prefill_multi(), d2h(), 6, 4, ["prefill tp 6", "decode tp 4"]),
        (store(), d2h(), 1, 1, ["prefill kv_connector", "SfaRemoteD2HConnector", "both sides"]),
        (prefill_multi(transfer_backend="kvoffload"), d2h("memfabric"), 1, 1,
         ["transfer_backend", "prefill 'kvoffload' != decode 'memfabric'", "same transfer_backend"]),
    ],
)
def test_pd_pair_errors(p_kv: Any, d_kv: Any, p_tp: int, d_tp: int, words: list[str]) -> None:
    prefill, decode = pair(p_kv, d_kv, p_tp, d_tp)
    with pytest.raises(ConfigError) as info:
        check_pd_pair(prefill, decode)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)


def test_pd_pair_missing_transfer_backends() -> None:
    prefill = prefill_settings(prefill_multi(), None, LAYOUT)
    decode = decode_settings(d2h(), DECODE_SPARSE, LAYOUT, **DECODE_KW)
    no_p = dataclasses.replace(prefill, d2h=D2HConnectorConfig())
    no_d = dataclasses.replace(decode, d2h=D2HConnectorConfig())
    with pytest.raises(ConfigError) as info:
        check_pd_pair(no_p, no_d)
    assert [e.split(":")[0] for e in info.value.errors] == [
        "prefill kv_connector_extra_config.transfer_backend",
        "decode kv_connector_extra_config.transfer_backend",
    ]


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (4, 1), (4, 2), (8, 4), (16, 16)])
def test_tp_contributors_partition_the_prefill_ranks(p_tp, d_tp):
    from kvcore.settings import tp_contributors, tp_target

    groups = [tp_contributors(p_tp, d_tp, r) for r in range(d_tp)]
    assert sorted(x for g in groups for x in g) == list(range(p_tp))  # every prefill rank feeds exactly one
    assert all(len(g) == p_tp // d_tp for g in groups)
    for r, g in enumerate(groups):
        assert all(tp_target(p_tp, d_tp, p) == r for p in g)


@pytest.mark.parametrize("p_tp, d_tp, rank", [(2, 4, 0), (6, 4, 0), (4, 2, 2), (0, 1, 0)])
def test_tp_contributors_reject_bad_ratios_and_ranks(p_tp, d_tp, rank):
    from kvcore.settings import tp_contributors

    with pytest.raises(ValueError):
        tp_contributors(p_tp, d_tp, rank)


def test_decode_ranks_bind_consecutive_ports():
    from kvcore.layout import KVLayout
    from kvcore.settings import decode_settings

    layout = KVLayout.for_mla(num_hidden_layers=2, kv_lora_rank=8, qk_rope_head_dim=4, block_size=16,
                              index_head_dim=8)
    s = decode_settings({"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer", "kv_port": 30000,
                         "kv_connector_extra_config": {"transfer_backend": "kvoffload"}},
                        {"sparse_kv_offload_config": {"enabled": True, "topk_buffer_size": 64, "dram_size_per_dp_GB": 1}},
                        layout, index_topk=32, max_num_seqs=1, max_model_len=64, dp=2, tp=4)
    assert s.control_ports() == list(range(30000, 30008))
    assert [s.control_port(d, t) for d in range(2) for t in range(4)] == list(range(30000, 30008))


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 4)])
def test_the_handshake_accepts_exactly_the_contributors_of_a_decode_rank(p_tp, d_tp):
    from kvcore.settings import tp_contributors, tp_handshake_problem

    for d in range(d_tp):
        for p in range(p_tp):
            problem = tp_handshake_problem(p_tp, p, d_tp, d)
            assert (problem == "") == (p in tp_contributors(p_tp, d_tp, d)), (p, d, problem)
            if problem:  # both sides' ranks named
                assert f"prefill tp rank {p} of {p_tp}" in problem and f"decode tp rank {d}" in problem


@pytest.mark.parametrize("p_tp, p_rank, d_tp, d_rank, words", [
    (1, 0, 2, 0, ["prefill tp 1", "decode tp 2", ">= decode TP"]),
    (6, 0, 4, 0, ["prefill tp 6", "decode tp 4", "divisible"]),
    (0, 0, 1, 0, ["prefill tp 0", "decode tp 1"]),
    (2, 2, 1, 0, ["prefill_tp_rank: 2", "0..1", "prefill tp 2"]),
    (2, 0, 1, 1, ["decode_tp_rank: 1", "0..0", "decode tp 1"]),
    (2, 0, 1, True, ["decode_tp_rank: True (bool)"]),
])
def test_the_handshake_names_both_values_of_a_mismatch(p_tp, p_rank, d_tp, d_rank, words):
    from kvcore.settings import tp_handshake_problem

    problem = tp_handshake_problem(p_tp, p_rank, d_tp, d_rank)
    for word in words:
        assert word in problem, (word, problem)


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 500), n=st.integers(0, 300), count=st.integers(1, 8))
def test_contributor_shares_partition_the_rows(start, n, count):
    from kvcore.settings import contributor_share

    shares = [contributor_share(start, start + n, i, count) for i in range(count)]
    assert shares[0][0] == start and shares[-1][1] == start + n
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    assert max(b - a for a, b in shares) - min(b - a for a, b in shares) <= 1


def test_a_contributor_outside_its_group_has_no_share():
    from kvcore.settings import contributor_share

    with pytest.raises(ValueError, match="contributor 2 outside 0..1"):
        contributor_share(0, 10, 2, 2)
