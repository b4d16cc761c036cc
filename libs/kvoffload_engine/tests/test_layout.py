"""The kvcore layout of a model config: the indexer rows of an fp8 indexer model are its keys in
float8_e4m3fn plus one float32 scale per 128-element block, stored as bytes; a plain model's, its dtype."""

from __future__ import annotations

import torch

from dsamodel.presets import tiny_config
from kvoffload_engine.model_layout import kv_layout


def test_the_layout_of_an_fp8_indexer_model():
    layout = kv_layout(tiny_config(fp8_indexer=True), 16)
    spec = layout.layers[0].indexer
    assert (spec.dtype, spec.width, spec.scale_bytes, spec.row_bytes) == (torch.float8_e4m3fn, 32, 4, 36)
    assert spec.storage == (torch.uint8, 36)
    assert kv_layout(tiny_config(), 16).layers[0].indexer.storage == (torch.bfloat16, 32)
