"""Byte views of vLLM's paged caches: contiguous per-layer tensors, and the 14 strided views into one
storage that vLLM 0.32.0 hands a connector for a DeepSeek-V4 model with the hybrid KV cache manager
(``shared/spec/vllm-dsa-kv-layout.md``: 5 groups, block stride 93,888 bytes, per-layer offsets). Each
layer's blocks are read and written in place, exactly their bytes and nothing of the layers beside them."""

from __future__ import annotations

import pytest
import torch

from kvoffload_vllm.block_bytes import block_bytes
from kvoffload_vllm.layout import LayoutMismatch

NUM_BLOCKS = 6
STRIDE = 93_888  # bytes: the widest group's page
# name: (dtype, block shape, strides of the block's dimensions in elements, offset in elements)
DSV4 = {
    "model.layers.0.attn.swa_cache": (torch.uint8, (1, 64, 584), (37376, 584, 1), 0),
    "model.layers.2.attn.swa_cache": (torch.uint8, (1, 64, 584), (37376, 584, 1), 37440),
    "model.layers.1.attn.swa_cache": (torch.uint8, (1, 64, 584), (37376, 584, 1), 0),
    "model.layers.3.attn.swa_cache": (torch.uint8, (1, 64, 584), (37376, 584, 1), 37440),
    "model.layers.1.attn.indexer.k_cache": (torch.uint8, (1, 64, 132), (8448, 132, 1), 0),
    "model.layers.3.attn.indexer.k_cache": (torch.uint8, (1, 64, 132), (8448, 132, 1), 8640),
    "model.layers.1.attn": (torch.uint8, (1, 64, 584), (37376, 584, 1), 17280),
    "model.layers.3.attn": (torch.uint8, (1, 64, 584), (37376, 584, 1), 17280 + 37440),
    "model.layers.2.attn": (torch.uint8, (1, 2, 584), (1168, 584, 1), 92160),
    "model.layers.1.attn.compressor.state_cache": (torch.float32, (1, 4, 2048), (8192, 2048, 1), 4320),
    "model.layers.3.attn.compressor.state_cache": (torch.float32, (1, 4, 2048), (8192, 2048, 1), 4320 + 8192),
    "model.layers.2.attn.compressor.state_cache": (torch.float32, (1, 8, 1024), (8192, 1024, 1), 0),
}
# the pages of one group's layers never overlap within a block (groups alias each other: a block id
# belongs to one group at a time)
GROUPS = [
    ["model.layers.0.attn.swa_cache", "model.layers.2.attn.swa_cache"],
    ["model.layers.1.attn.swa_cache", "model.layers.3.attn.swa_cache"],
    ["model.layers.1.attn.indexer.k_cache", "model.layers.3.attn.indexer.k_cache", "model.layers.1.attn"],
    ["model.layers.1.attn.compressor.state_cache", "model.layers.3.attn.compressor.state_cache"],
]


def views(storage: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {}
    for name, (dtype, shape, strides, offset) in DSV4.items():
        base = storage.view(dtype)
        step = STRIDE // dtype.itemsize
        out[name] = torch.as_strided(base, (NUM_BLOCKS, *shape), (step, *strides), offset)
    return out


def test_every_dsv4_view_reads_and_writes_its_own_bytes_in_place():
    storage = torch.zeros(NUM_BLOCKS * STRIDE, dtype=torch.uint8)
    caches = views(storage)
    pages = {name: block_bytes(t, name) for name, t in caches.items()}
    assert pages["model.layers.0.attn.swa_cache"].shape == (NUM_BLOCKS, 64 * 584)  # 584 B rows (fp8 latent + rope)
    assert pages["model.layers.1.attn.indexer.k_cache"].shape == (NUM_BLOCKS, 64 * 132)  # 132 B indexer rows
    assert pages["model.layers.1.attn.compressor.state_cache"].shape == (NUM_BLOCKS, 4 * 2048 * 4)
    for group in GROUPS:
        storage.zero_()
        ids = torch.tensor([4, 1])
        for i, name in enumerate(group):
            page = pages[name]
            page.index_copy_(0, ids, torch.full((2, page.shape[1]), i + 1, dtype=torch.uint8))
        for i, name in enumerate(group):  # each layer reads back its own bytes, untouched by the others
            got = pages[name].index_select(0, ids)
            assert torch.equal(got, torch.full_like(got, i + 1)), name
            assert pages[name][0].count_nonzero() == 0  # other blocks untouched
        written = sum(pages[n].shape[1] for n in group) * 2
        assert storage.count_nonzero() == written  # exactly the pages written, nothing else
        t = caches[group[0]]  # and vLLM's own view of block 4 sees what the byte view wrote
        assert bool((t[4].view(torch.uint8) == 1).all())


def test_a_contiguous_layer_is_its_blocks_back_to_back_and_a_sparse_block_is_refused():
    t = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    pages = block_bytes(t)
    assert pages.shape == (3, 32) and pages.data_ptr() == t.data_ptr()
    assert torch.equal(pages[1], t[1].contiguous().view(torch.uint8).view(-1))
    with pytest.raises(LayoutMismatch, match="layer 'x': a block .* is not one dense run of bytes"):
        block_bytes(torch.zeros(3, 4, 6)[:, :, :4], "x")  # rows of 4 of every 6 elements
    with pytest.raises(LayoutMismatch, match="no dense blocks"):
        block_bytes(torch.zeros(3, 4, 4).transpose(1, 2), "y")
