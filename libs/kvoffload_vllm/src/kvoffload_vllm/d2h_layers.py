"""The D2H connector's layers as the transfer contract numbers them, each with its KV cache group.

Layer i on the wire (``LayerLayout.layer``) is ``names[i]``: every attention layer of every KV cache
group (``kvoffload_vllm.kv_groups``), group by group, each group's layers in vLLM's order (one group:
the group's order, as before the hybrid KV cache manager). A layer's blocks are its group's: the
group's block table and block size (``LayerLayout.block_size``); with several groups, layers of
different groups are views of the same memory (a block id belongs to one group at a time), so a
layer is read and written only through its own group's block ids. Rows on the wire are tokens: a row
of a layer is ``page_bytes / block_size`` bytes of its block, and whole blocks move byte for byte
(``kvoffload_vllm.group_caches``: any block stride, in place).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvcore.layout import dtype_name
from kvoffload_proto.v1 import transfer_pb2
from kvoffload_vllm.group_caches import GroupCaches
from kvoffload_vllm.kv_groups import KVGroup
from kvoffload_vllm.layout import LayoutMismatch
from pdlink.layout_messages import layer_layout


@dataclass(frozen=True)
class D2HLayers:
    """``names[i]``: layer i; ``group_of[i]``/``plane_of[i]``: its group's index and its position in
    the group; ``pages[i]``: its cache as ``[num_blocks, page_bytes]`` uint8; ``dtypes[i]``: the
    cache's torch dtype name; ``leads[i]``: the size of a block's outermost dimension (vLLM's CPU
    attention: the rank's KV heads)."""

    groups: tuple[KVGroup, ...]
    names: tuple[str, ...]
    group_of: tuple[int, ...]
    plane_of: tuple[int, ...]
    pages: tuple[torch.Tensor, ...]
    dtypes: tuple[str, ...]
    leads: tuple[int, ...]

    @classmethod
    def of(cls, groups: tuple[KVGroup, ...], caches: Mapping[str, torch.Tensor], num_blocks: int) -> D2HLayers:
        """vLLM's ``caches`` of ``groups``; LayoutMismatch naming the layer when one is missing, not
        ``num_blocks`` dense blocks, or its block does not split into the group's token rows."""
        names, group_of, plane_of, pages, dtypes, leads = [], [], [], [], [], []
        for g in groups:
            group_caches = GroupCaches.of(g, caches, num_blocks)
            for plane, (name, page) in enumerate(zip(g.layer_names, group_caches.pages, strict=True)):
                if page.shape[1] % g.block_size:
                    raise LayoutMismatch(
                        f"layer {name!r}: a block of {page.shape[1]} bytes does not split into "
                        f"{g.block_size} token rows (KV cache group {g.index})"
                    )
                names.append(name)
                group_of.append(g.index)
                plane_of.append(plane)
                pages.append(page)
                dtypes.append(dtype_name(caches[name].dtype))
                leads.append(int(caches[name].shape[1]))
        if not names:
            raise LayoutMismatch("vLLM registered no KV cache layer")
        return cls(
            tuple(groups), tuple(names), tuple(group_of), tuple(plane_of), tuple(pages), tuple(dtypes), tuple(leads)
        )

    def index(self, name: str) -> int:
        """The wire index of layer ``name``."""
        return self.names.index(name)

    def block_size(self, layer: int) -> int:
        """Tokens per block of ``layer`` (its group's)."""
        return self.groups[self.group_of[layer]].block_size

    def page_bytes(self, layer: int) -> int:
        return int(self.pages[layer].shape[1])

    def row_bytes(self, layer: int) -> int:
        """Bytes of one token row of ``layer``."""
        return self.page_bytes(layer) // self.block_size(layer)

    def layer_layouts(self, *, engine_blocks: bool = False) -> list[transfer_pb2.LayerLayout]:
        """Every layer as the prefill describes it to a decode (no shared-memory regions: vLLM's blocks
        are streamed out of its cache); ``engine_blocks``: with each layer's block 0 address and block
        stride in this process, where a transfer engine reads them."""
        return [
            layer_layout(
                i,
                slot=i,
                main_row_bytes=self.row_bytes(i),
                main_dtype=self.dtypes[i],
                block_size=self.block_size(i),
                engine_block=(page.data_ptr(), page.stride(0)) if engine_blocks else None,
            )
            for i, page in enumerate(self.pages)
        ]
