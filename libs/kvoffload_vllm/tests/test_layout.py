"""vLLM's per-layer caches as pool geometry: what is accepted, what is refused (naming the layer),
and that a block goes through the pool's row view byte for byte."""

from __future__ import annotations

import pytest
import torch

from kvoffload_vllm.layout import CacheLayout, LayoutMismatch, model_key_prefix

NB, BS = 6, 4
SHAPE = (NB, 2, BS, 16)  # [num_blocks, kv heads, rows, 2 * head_size] as vLLM's CPU backend lays it out


def _caches(n=3, shape=SHAPE, dtype=torch.float32):
    return {f"layers.{i}.attn": torch.randn(shape, dtype=dtype) for i in range(n)}


def test_a_good_layout_gives_one_plane_per_layer_in_layer_order():
    caches = _caches()
    order = list(caches)[::-1]
    layout = CacheLayout.of(caches, order, NB, BS, page_bytes=2 * BS * 16 * 4)
    assert layout.layer_names == tuple(order) and layout.plane(order[0]) == 0
    assert layout.block_bytes == 2 * BS * 16 * 4 and layout.block_shape == SHAPE[1:]


@pytest.mark.parametrize(
    "caches,order,page,message",
    [
        (_caches(), ["layers.0.attn", "layers.1.attn"], 512, "the KV cache config names"),
        ({"a": (torch.zeros(SHAPE), torch.zeros(SHAPE))}, ["a"], 512, "one tensor per layer, got tuple"),
        ({"a": torch.zeros((NB + 1,) + SHAPE[1:])}, ["a"], 512, "needs a contiguous [num_blocks=6, ...] tensor"),
        ({"a": torch.zeros(SHAPE).transpose(1, 2)}, ["a"], 512, "contiguous: False"),
        ({"a": torch.zeros(SHAPE), "b": torch.zeros(SHAPE, dtype=torch.bfloat16)}, ["a", "b"], 512, "layer 'b': block"),
        ({"a": torch.zeros(SHAPE)}, ["a"], 1024, "is 512 bytes, the KV cache spec says 1024"),
    ],
)
def test_a_layout_the_connector_cannot_copy_is_refused_with_the_layer(caches, order, page, message):
    with pytest.raises(LayoutMismatch) as e:
        CacheLayout.of(caches, order, NB, BS, page)
    assert message in str(e.value)


def test_the_key_prefix_changes_with_anything_that_changes_a_block():
    base = {"dtype": "torch.float32", "block_size": 128, "device": "cpu", "layers": ["a", "b"]}
    prefix = model_key_prefix("m", base)
    assert prefix == model_key_prefix("m", dict(reversed(base.items())))  # order of the fields does not matter
    assert prefix.startswith("vllm:m:")
    for key, value in (("dtype", "torch.bfloat16"), ("block_size", 16), ("device", "cuda"), ("layers", ["a"])):
        assert model_key_prefix("m", {**base, key: value}) != prefix
    assert model_key_prefix("other", base) != prefix
