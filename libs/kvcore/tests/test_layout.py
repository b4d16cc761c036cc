"""Layout: cache specs, byte sizes and physical indices of cache names."""

import pytest
import torch

from kvcore.layout import CacheSpec, KVLayout, parse_dtype, physical_index


@pytest.mark.parametrize(
    "name, base, expected",
    [
        ("model.layers.0.self_attn.attn", 61, 0),
        ("model.layers.17.self_attn.indexer.k_cache", 61, 17),
        ("model.mtp.0", 61, 61),
        ("model.mtp.layers.2.attn", 61, 63),
        ("mtp.1", 4, 5),
        ("cache_12_attn", 4, 12),
    ],
)
def test_physical_index(name, base, expected):
    assert physical_index(name, base) == expected


def test_physical_index_without_integer_is_an_error():
    with pytest.raises(ValueError, match="no layer index"):
        physical_index("model.attn", 4)


def test_mla_layout_sizes_dsv32_like():
    layout = KVLayout.for_mla(
        num_hidden_layers=61,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        block_size=64,
        dtype="bfloat16",
        num_mtp_layers=1,
        index_head_dim=128,
        index_dtype="fp8",
        index_scale_bytes=4,
    )
    assert layout.num_layers == 62 and layout.num_mtp_layers == 1
    assert layout.layers[0].main.row_bytes == 576 * 2
    assert layout.layers[0].indexer.row_bytes == 128 + 4
    assert layout.main_bytes_per_token == 62 * 1152
    assert layout.bytes_per_token == 62 * (1152 + 132)
    assert layout.layers[61].is_mtp and not layout.layers[60].is_mtp
    names = layout.cache_names()
    assert len(names) == 124
    assert [physical_index(n, 61) for n in names[-2:]] == [61, 61]


def test_layout_without_indexer():
    layout = KVLayout.for_mla(num_hidden_layers=2, kv_lora_rank=8, qk_rope_head_dim=4, block_size=4, dtype="float32")
    assert not layout.has_indexer
    assert layout.bytes_per_token == 2 * 12 * 4


@pytest.mark.parametrize("bad", ["int8", "bf16x", 3])
def test_unknown_dtype(bad):
    with pytest.raises((ValueError, TypeError)):
        parse_dtype(bad)


def test_bad_specs():
    with pytest.raises(ValueError, match="width"):
        CacheSpec(0, torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        KVLayout.for_mla(num_hidden_layers=2, kv_lora_rank=8, qk_rope_head_dim=4, block_size=0)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        KVLayout.for_mla(num_hidden_layers=0, kv_lora_rank=8, qk_rope_head_dim=4, block_size=4)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "fp8"])
def test_dtype_name_inverts_parse_dtype(name):
    from kvcore.layout import dtype_name

    assert dtype_name(parse_dtype(name)) == name


def test_dtype_name_refuses_unsupported():
    from kvcore.layout import dtype_name

    with pytest.raises(ValueError, match="not supported"):
        dtype_name(torch.int8)


def test_a_gqa_layout_holds_k_and_v_of_every_kv_head_per_row():
    lay = KVLayout.for_gqa(
        num_hidden_layers=30, num_key_value_heads=3, head_dim=64, block_size=16, dtype="bfloat16", index_head_dim=96
    )
    assert lay.num_layers == 30 and lay.num_mtp_layers == 0
    spec = lay.layers[7]
    assert (spec.main.kind, spec.main.width, spec.main.row_bytes) == ("k_v", 384, 768)
    assert spec.indexer is not None and spec.indexer.width == 96
    assert KVLayout.for_mla(num_hidden_layers=2, kv_lora_rank=8, qk_rope_head_dim=8, block_size=4).layers[
        0
    ].main.kind == ("mla_latent")
    with pytest.raises(ValueError, match="row kind must be one of"):
        CacheSpec(8, torch.bfloat16, kind="kv")
