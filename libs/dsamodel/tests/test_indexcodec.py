"""The fp8 indexer cache (DeepSeek-V3.2's format): keys as float8_e4m3fn plus one float32 scale per
128-element block, packed into byte rows; the codec's bytes and error, and how the selection of an
fp8 indexer compares with the plain (model dtype) one on test prompts. (The layout:
libs/kvoffload_engine/tests/test_layout.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsamodel.dense_reference import select_topk
from dsamodel.indexcodec import FP8_MAX, IndexCodec
from dsamodel.model import DSAModel
from dsamodel.presets import init_weights, tiny_config


def _codec(index_head_dim: int, fp8: bool = True) -> IndexCodec:
    cfg = dataclasses.replace(tiny_config(fp8_indexer=fp8), index_head_dim=index_head_dim)
    return IndexCodec(cfg)


@pytest.mark.parametrize(("di", "row_bytes"), [(32, 36), (128, 132), (200, 208)])
def test_an_fp8_row_is_the_key_bytes_then_one_float32_scale_per_128_elements(di, row_bytes):
    codec = _codec(di)
    assert codec.storage(torch.bfloat16) == (torch.uint8, row_bytes)
    keys = torch.randn(7, di) * torch.logspace(-3, 3, 7)[:, None]  # rows of very different magnitude
    rows = codec.encode(keys)
    assert rows.shape == (7, row_bytes) and rows.dtype == torch.uint8
    blocks = -(-di // 128)
    scales = rows[:, di:].contiguous().view(torch.float32)  # [7, blocks]
    for b in range(blocks):
        part = keys[:, b * 128 : (b + 1) * 128]
        assert torch.equal(scales[:, b], part.abs().amax(1) / FP8_MAX)
        q = rows[:, b * 128 : min((b + 1) * 128, di)].contiguous().view(torch.float8_e4m3fn).float()
        assert torch.equal(q, (part / scales[:, b : b + 1]).to(torch.float8_e4m3fn).float())
    back = codec.decode(rows)
    amax = torch.stack([keys[:, b * 128 : (b + 1) * 128].abs().amax(1) for b in range(blocks)], 1)  # [7, blocks]
    bound = amax.repeat_interleave(128, 1)[:, :di] / 16  # e4m3: 3 mantissa bits
    assert back.dtype == torch.float32 and bool(((back - keys).abs() <= bound).all())
    assert torch.equal(codec.decode(codec.encode(torch.zeros(2, di))), torch.zeros(2, di))  # no 0/0
    assert codec.decode(rows[None]).shape == (1, 7, di)  # any leading dims


def test_the_plain_codec_stores_keys_as_they_are():
    codec = _codec(32, fp8=False)
    keys = torch.randn(3, 32, dtype=torch.bfloat16)
    assert codec.storage(torch.bfloat16) == (torch.bfloat16, 32)
    assert codec.encode(keys) is keys and codec.decode(keys) is keys


def test_fp8_selection_against_the_plain_indexer_on_test_prompts():
    """Same weights, the indexer reading fp8 keys vs the plain ones: the share of each query's
    top-k (64 of up to 1500 visible tokens) both select, over every layer and every position of
    three prompts (seeded, so the figures are exact): 0.984 on average, 0.906 at the worst position
    of the worst layer; the test holds them to 0.97 and 0.9."""
    overlaps, worst = [], 1.0
    plain = init_weights(DSAModel(tiny_config(dtype="float32")), seed=0)
    fp8 = init_weights(DSAModel(tiny_config(dtype="float32", fp8_indexer=True)), seed=0)
    for seed, n in ((1, 300), (2, 900), (3, 1500)):
        tokens = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
        h_plain = plain.embed(tokens)
        positions = torch.arange(n)
        for layer_p, layer_f in zip(plain.layers, fp8.layers, strict=True):
            proj = layer_p.project(h_plain, positions)
            a = select_topk(layer_p, proj, positions, 64, None)  # [n, 64]
            b = select_topk(layer_f, layer_f.project(h_plain, positions), positions, 64, None)
            valid = a >= 0
            same = torch.tensor([len(set(x[x >= 0].tolist()) & set(y[y >= 0].tolist())) for x, y in zip(a, b)])
            share = same / valid.sum(1)  # [n]
            overlaps.append(float(share.mean()))
            worst = min(worst, float(share.min()))
            attn = layer_p.self_attn
            h_plain = layer_p.finish(h_plain, torch.zeros(n, attn.num_heads, attn.kv_lora_rank))
    mean = sum(overlaps) / len(overlaps)
    print(f"fp8 vs plain indexer top-k overlap: mean {mean:.4f}, worst position {worst:.4f}")
    assert mean >= 0.97 and worst >= 0.9, (mean, worst)
