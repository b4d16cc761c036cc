"""vLLM's KV cache groups as pool planes: byte views of contiguous per-layer tensors and of the strided
views into one storage that vLLM 0.32.0 hands a connector for a DeepSeek-V4 model with the hybrid KV
cache manager (5 groups of block sizes 64/256/4/8, block stride 93,888 bytes, per-layer offsets, 584-byte
latent rows, 132-byte indexer rows, float32 compressor states). Each layer's blocks are read and written
in place, exactly their bytes and nothing of the layers beside them; each group saved into a real local
host pool of its own and loaded into other blocks of a fresh storage comes back byte for byte."""

from __future__ import annotations

import uuid

import pytest
import torch

from kvcore.pool.local import LocalHostPool
from kvoffload_vllm.block_bytes import block_bytes
from kvoffload_vllm.group_caches import GroupCaches
from kvoffload_vllm.kv_groups import KVGroup
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
# vLLM's groups (block size, layers): the pages of one group's layers never overlap within a block (groups
# alias each other: a block id belongs to one group at a time)
DSV4_GROUPS = [
    (64, ["model.layers.0.attn.swa_cache", "model.layers.2.attn.swa_cache"]),
    (64, ["model.layers.1.attn.swa_cache", "model.layers.3.attn.swa_cache"]),
    (
        256,
        [
            "model.layers.1.attn.indexer.k_cache",
            "model.layers.3.attn.indexer.k_cache",
            "model.layers.1.attn",
            "model.layers.3.attn",
            "model.layers.2.attn",
        ],
    ),
    (4, ["model.layers.1.attn.compressor.state_cache", "model.layers.3.attn.compressor.state_cache"]),
    (8, ["model.layers.2.attn.compressor.state_cache"]),
]
GROUPS = [names for _, names in DSV4_GROUPS]


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


def _groups() -> list[KVGroup]:
    return [KVGroup(i, tuple(names), bs, ()) for i, (bs, names) in enumerate(DSV4_GROUPS)]


def test_each_dsv4_group_goes_through_its_own_pool_and_back_into_other_blocks_byte_for_byte():
    torch.manual_seed(0)
    source = torch.randint(0, 256, (NUM_BLOCKS * STRIDE,), dtype=torch.uint8)
    target = torch.zeros_like(source)
    src, dst = views(source), views(target)
    expected = torch.zeros_like(source)
    want = views(expected)
    for group in _groups():
        a, b = GroupCaches.of(group, src, NUM_BLOCKS), GroupCaches.of(group, dst, NUM_BLOCKS)
        assert a.page_bytes == tuple(block_bytes(src[n]).shape[1] for n in group.layer_names)
        geometry = a.geometry(4)
        assert geometry.plane_row_bytes == a.page_bytes and geometry.block_size == 1  # a row is a page
        pool = LocalHostPool.create(f"kvoffload-test-{uuid.uuid4().hex[:8]}", geometry)
        try:
            keys = [f"g{group.index}-{i}".encode() for i in range(2)]
            pool.alloc(keys)
            for plane in range(len(group.layer_names)):
                pool.put_from(keys, plane, a.read(plane, torch.tensor([4, 1])))
            for plane, name in enumerate(group.layer_names):
                staging = torch.empty((2, 1, b.page_bytes[plane]), dtype=torch.uint8)
                pool.get_into(keys, plane, staging)
                b.write(plane, torch.tensor([2, 5]), staging)
                block_bytes(want[name])[[2, 5]] = block_bytes(src[name])[[4, 1]]
        finally:
            pool.close()
    assert torch.equal(target, expected)  # every layer's pages where they belong, nothing else written
    assert int(target.count_nonzero()) > 0


def test_a_group_whose_layer_vllm_did_not_register_is_refused_naming_it():
    group = KVGroup(2, ("model.layers.1.attn", "model.layers.9.attn"), 256, ())
    caches = views(torch.zeros(NUM_BLOCKS * STRIDE, dtype=torch.uint8))
    with pytest.raises(LayoutMismatch, match="'model.layers.9.attn' of KV cache group 2: vLLM registered no cache"):
        GroupCaches.of(group, caches, NUM_BLOCKS)
    with pytest.raises(LayoutMismatch, match=r"needs \[num_blocks=7, ...\]"):
        GroupCaches.of(KVGroup(0, ("model.layers.1.attn",), 256, ()), caches, 7)
