"""One KV cache group's caches as pool planes: each layer's blocks as bytes, read and written in place.

Plane i of the group's pool is layer ``group.layer_names[i]``; a pool object is one block of every
layer of the group (one row of the layer's page bytes per plane: a block is copied byte for byte,
whatever its inner order, and pages need not split into token rows — a DeepSeek-V4 indexer page
holds 256 tokens in 8,640 bytes). The byte views come from ``kvoffload_vllm.block_bytes``: any
block stride, so the strided views of a hybrid KV cache are written in place, nothing of the layers
and groups that share their storage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvcore.hotcache.gather import write_pages
from kvcore.pool.geometry import PoolGeometry
from kvoffload_vllm.block_bytes import block_bytes
from kvoffload_vllm.kv_groups import KVGroup
from kvoffload_vllm.layout import LayoutMismatch


@dataclass(frozen=True)
class GroupCaches:
    """``pages[i]``: layer ``group.layer_names[i]``'s cache as ``[num_blocks, page_bytes_i]`` uint8."""

    group: KVGroup
    pages: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, group: KVGroup, caches: Mapping[str, object], num_blocks: int) -> GroupCaches:
        """The group's layers of vLLM's ``caches``; LayoutMismatch naming the layer when one is missing,
        not a tensor, not ``num_blocks`` blocks, or its blocks are not dense runs of bytes."""
        pages = []
        for name in group.layer_names:
            t = caches.get(name)
            if not isinstance(t, torch.Tensor):
                raise LayoutMismatch(
                    f"layer {name!r} of KV cache group {group.index}: vLLM registered "
                    f"{type(t).__name__ if t is not None else 'no cache'}, the connector needs one tensor"
                )
            if t.dim() < 2 or t.shape[0] != num_blocks:
                raise LayoutMismatch(f"layer {name!r}: needs [num_blocks={num_blocks}, ...], got shape {list(t.shape)}")
            pages.append(block_bytes(t, name))
        return cls(group, tuple(pages))

    @property
    def page_bytes(self) -> tuple[int, ...]:
        return tuple(p.shape[1] for p in self.pages)

    @property
    def object_bytes(self) -> int:
        """Bytes of one pool object: one block of every layer of the group."""
        return sum(self.page_bytes)

    def geometry(self, num_objects: int) -> PoolGeometry:
        return PoolGeometry(1, self.page_bytes, num_objects, tuple((i, "main") for i in range(len(self.pages))))

    def read(self, plane: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``block_ids`` of layer ``plane`` as ``[n, 1, page_bytes]`` host bytes (a copy: the pool's
        source rows)."""
        page = self.pages[plane]
        return page.index_select(0, block_ids.to(page.device)).cpu().unsqueeze(1)

    def write(self, plane: int, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """``data`` (``[n, 1, page_bytes]``) into blocks ``block_ids`` of layer ``plane``, in place."""
        page = self.pages[plane]
        write_pages(page, block_ids, data.view(len(block_ids), -1))
