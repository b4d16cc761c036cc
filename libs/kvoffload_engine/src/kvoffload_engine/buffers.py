"""Prefill device layer buffers: one main tensor (and one indexer tensor) per physical slot.

Built from a ``BufferPlan``'s merged descriptors through kvcore's counting allocator, so the
device bytes are exactly ``plan.accounting(num_blocks).device_bytes``. On the CPU the buffers can
live in a named shared-memory segment (one plane per descriptor), so a decode process on the same
host copies a layer straight out of them (the same-host D2H pull). A slot also remembers what
it currently holds (``Residency``: layer, request, valid tokens), so an independent layer skips
reloading a prefix that is still there while a reused layer reloads its whole prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.device import DeviceAllocator
from kvcore.plan import BufferPlan
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.segment import SharedSegment


@dataclass(frozen=True)
class Residency:
    """Slot contents: rows ``[0, num_tokens)`` of ``layer`` for ``request_id``."""

    layer: int
    request_id: str
    num_tokens: int


class LayerBuffers:
    """Per-slot device tensors of ``num_blocks * block_size`` token rows in the model dtype (an fp8
    indexer cache: uint8 rows of keys + scales, ``CacheSpec.storage``)."""

    def __init__(
        self,
        plan: BufferPlan,
        num_blocks: int,
        allocator: DeviceAllocator,
        dtype: torch.dtype,
        *,
        segment_name: str | None = None,
        attach: bool = False,
    ) -> None:
        """``segment_name``: the buffers live in that shared-memory segment, created here (and
        removed by ``close``), or with ``attach`` the one another process created for the same plan
        and ``num_blocks`` (a TP follower's, which rank 0 serves to the decodes it feeds)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.plan = plan
        self.block_size = plan.layout.block_size
        self.num_blocks = num_blocks
        rows = num_blocks * self.block_size
        self._main: dict[int, torch.Tensor] = {}
        self._indexer: dict[int, torch.Tensor] = {}
        self.segment: SharedSegment | None = None
        self.plane_of: dict[tuple[int, str], int] = {}  # (slot, kind) -> plane of the segment
        if segment_name is not None:
            if allocator.device.type != "cpu":
                raise ValueError(f"shared-memory layer buffers need the cpu device, not {allocator.device}")
            labels = tuple((d.slot, d.kind) for d in plan.descriptors)
            geo = PoolGeometry(self.block_size, tuple(d.spec.row_bytes for d in plan.descriptors), num_blocks, labels)
            self.segment = (
                SharedSegment.attach(segment_name) if attach else SharedSegment.create(segment_name, geo, replace=True)
            )
            if attach and self.segment.geometry != geo:
                self.segment.close()
                raise ValueError(
                    f"segment {segment_name!r} is not laid out for this plan ({self.segment.geometry} != {geo})"
                )
            self.plane_of = {label: p for p, label in enumerate(labels)}
        for p, d in enumerate(plan.descriptors):
            target = self._main if d.kind == "main" else self._indexer
            tag = f"prefill.{d.kind}"
            sdtype, width = d.spec.storage if d.kind == "indexer" else (dtype, d.spec.width)  # fp8 indexer: bytes
            if self.segment is None:
                target[d.slot] = allocator.zeros((rows, width), sdtype, tag=tag)  # [rows, W]
            else:
                view = self.segment.plane(p).view(sdtype).view(rows, width)  # [rows, W] shared
                target[d.slot] = allocator.track(view, tag)
        self._residency: dict[int, Residency | None] = {s: None for s in range(plan.num_buffers)}
        self._owner = not attach

    def close(self) -> None:
        """Release the shared-memory segment (if any; removed if created here); the buffers are
        unusable afterwards."""
        if self.segment is not None:
            self.segment.close()
            if self._owner:
                self.segment.unlink()
            self.segment = None

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def main(self, layer: int) -> torch.Tensor:
        """[rows, kv_lora_rank + rope] rows of ``layer``'s slot."""
        return self._main[self.plan.slot_of(layer)]

    def indexer(self, layer: int) -> torch.Tensor:
        """[rows, W] indexer rows of ``layer``'s slot (``model.index_codec`` encoded)."""
        slot = self.plan.slot_of(layer)
        if slot not in self._indexer:
            raise ValueError(f"layer {layer} has no indexer cache")
        return self._indexer[slot]

    def blocks(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer viewed as blocks: [num_blocks, block_size, W]."""
        return t.view(self.num_blocks, self.block_size, t.shape[-1])

    def residency(self, layer: int) -> Residency | None:
        return self._residency[self.plan.slot_of(layer)]

    def set_residency(self, layer: int, request_id: str, num_tokens: int) -> None:
        self._residency[self.plan.slot_of(layer)] = Residency(layer, request_id, num_tokens)

    def forget(self, layer: int) -> None:
        """The slot's contents are unknown (a failed load or compute)."""
        self._residency[self.plan.slot_of(layer)] = None

    def load_from(self, layer: int, request_id: str, num_tokens: int) -> int:
        """First block to load so that the slot holds ``layer``'s rows [0, num_tokens) of the request.

        0 unless the slot still holds a prefix of the same layer and request (an independent layer
        between chunks), then the first block it does not fully hold.
        """
        r = self.residency(layer)
        if r is not None and r.layer == layer and r.request_id == request_id and r.num_tokens <= num_tokens:
            return r.num_tokens // self.block_size
        return 0
