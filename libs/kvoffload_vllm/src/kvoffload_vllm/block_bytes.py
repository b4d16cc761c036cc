"""A layer's paged KV cache as the bytes of its blocks, ``[num_blocks, page_bytes]``, over whatever
strides vLLM gave it, without a copy.

One KV cache group of contiguous per-layer tensors is the simple case. With vLLM's hybrid KV cache
manager (several groups) every layer is a view into one storage whose block stride is the widest
group's page, at its own offset, its block dense inside (for a DeepSeek-V4 model:
``(num_blocks, 1, 64, 584)`` uint8 with strides ``(93888, 37376, 584, 1)``; float32 state caches with
strides in elements). Block ``b`` of such a layer is ``page_bytes`` bytes at ``offset + b x
block_stride``: the byte view reads (``index_select``) and writes
(``kvcore.hotcache.gather.write_pages``) exactly those, in place, and nothing of the layers and
groups that share the storage.
"""

from __future__ import annotations

import torch

from kvoffload_vllm.layout import LayoutMismatch


def block_bytes(cache: torch.Tensor, name: str = "cache") -> torch.Tensor:
    """``cache`` (``[num_blocks, ...]``, any block stride, each block dense) as ``[num_blocks, page_bytes]``
    uint8 sharing its storage; ``LayoutMismatch`` naming ``name`` when a block is not one dense run of bytes."""
    if cache.dim() < 2 or cache.stride(-1) != 1:
        raise LayoutMismatch(
            f"layer {name!r}: shape {list(cache.shape)} strides {list(cache.stride())}: no dense blocks"
        )
    raw = cache.view(torch.uint8)  # the last dimension scales to bytes
    block = raw[0]
    if not block.is_contiguous():
        raise LayoutMismatch(
            f"layer {name!r}: a block {list(block.shape)} with strides {list(block.stride())} "
            "is not one dense run of bytes"
        )
    return torch.as_strided(raw, (raw.shape[0], block.numel()), (raw.stride(0), 1), raw.storage_offset())
