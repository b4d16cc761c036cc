"""Decode node settings: control ports, host-pool sizing, top-k buffer rules, and every decode rule."""

from __future__ import annotations

from typing import Any

import pytest
from settings_support import (
    BLOCK,
    DECODE_KW,
    DECODE_SPARSE,
    EXTRA,
    KV_LORA_RANK,
    LAYOUT,
    MAIN_BYTES_PER_TOKEN,
    NUM_LAYERS,
    ROPE_DIM,
    SPARSE,
    additional,
    assert_error,
    d2h,
    decode_errors,
    multi,
    store,
)

from kvcore.config.connectors import D2HConnectorConfig
from kvcore.config.decode_settings import DecodeSettings, decode_settings
from kvcore.layout import KVLayout

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
    errors = decode_errors(
        d2h(), additional(enabled=True, dram_size_per_dp_GB=4), max_num_seqs=seqs, max_model_len=length
    )
    assert_error(
        errors, f"{SPARSE}.dram_size_per_dp_GB", [f"got 4 ({4 * 2**30} bytes)", f"{needed} bytes", f">= {gib}"]
    )
    exact = decode_settings(
        d2h(),
        additional(enabled=True, dram_size_per_dp_GB=gib),
        LAYOUT,
        index_topk=2048,
        max_num_seqs=seqs,
        max_model_len=length,
    )
    assert exact.host_bytes_needed == needed and exact.host_pool_bytes == gib * 2**30


def test_control_ports() -> None:
    settings = decode_settings(d2h(kv_port=20050), DECODE_SPARSE, LAYOUT, **DECODE_KW, dp=2, tp=4)
    assert settings.control_port(0, 0) == 20050
    assert settings.control_port(1, 2) == 20050 + 1 * 4 + 2
    assert settings.control_ports() == list(range(20050, 20058))


@pytest.mark.parametrize(
    ("dp_rank", "tp_rank", "word"),
    [
        (2, 0, "dp_rank"),
        (-1, 0, "dp_rank"),
        (0, 4, "tp_rank"),
        (0, -1, "tp_rank"),
        (True, 0, "dp_rank"),
        (0, 1.0, "tp_rank"),
    ],
)
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
    (
        d2h(),
        additional(enabled=True, topk_buffer_size=1024),
        {"index_topk": 2048},
        f"{SPARSE}.topk_buffer_size",
        ["got 1024", ">= index_topk 2048"],
    ),
    (
        d2h(),
        additional(enabled=True, topk_buffer_size=4000),
        {"index_topk": 2048},
        f"{SPARSE}.topk_buffer_size",
        ["got 4000", "divisible by block_size 64", "4000 % 64 = 32"],
    ),
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
    settings = decode_settings(
        d2h(), additional(keep_device_kv_cache=True), LAYOUT, **{**DECODE_KW, "index_topk": None}
    )
    assert not settings.sparse.enabled
    assert any("keep_device_kv_cache" in w for w in settings.warnings)


def test_decode_kv_both_is_a_consumer() -> None:
    assert decode_settings(d2h(role="kv_both"), DECODE_SPARSE, LAYOUT, **DECODE_KW).kv_port == 20050


def test_decode_ranks_bind_consecutive_ports():
    layout = KVLayout.for_mla(num_hidden_layers=2, kv_lora_rank=8, qk_rope_head_dim=4, block_size=16, index_head_dim=8)
    s = decode_settings(
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": "kv_consumer",
            "kv_port": 30000,
            "kv_connector_extra_config": {"transfer_backend": "kvoffload"},
        },
        {"sparse_kv_offload_config": {"enabled": True, "topk_buffer_size": 64, "dram_size_per_dp_GB": 1}},
        layout,
        index_topk=32,
        max_num_seqs=1,
        max_model_len=64,
        dp=2,
        tp=4,
    )
    assert s.control_ports() == list(range(30000, 30008))
    assert [s.control_port(d, t) for d in range(2) for t in range(4)] == list(range(30000, 30008))
