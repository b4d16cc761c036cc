"""The prefill buffer plan: which physical device buffer ("slot") each layer uses.

Independent layers get a dedicated slot. The other layers are bucketed by identical main-cache
spec; each bucket of R layers gets ``min(B, R)`` slots, assigned round-robin in layer order, so
the layer before L in the same slot is L's *previous occupant* (the one the reuse gate waits for).
Each slot becomes one main tensor shared by its layers plus one indexer tensor if any of its
layers has an indexer ("descriptor merge"). Memory accounting compares device bytes with and
without reuse and gives the logical/physical scale factor the scheduler's KV budget uses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import structlog

from kvcore.layout import CacheSpec, KVLayout

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Descriptor:
    """One physical device tensor after the merge: a slot's main or indexer cache."""

    slot: int
    kind: Literal["main", "indexer"]
    layers: tuple[int, ...]
    spec: CacheSpec

    def nbytes(self, num_blocks: int, block_size: int) -> int:
        return num_blocks * block_size * self.spec.row_bytes


@dataclass(frozen=True)
class MemoryAccounting:
    """Device KV bytes for buffers of ``num_blocks`` blocks, with and without reuse."""

    num_blocks: int
    device_bytes: int
    device_bytes_no_reuse: int

    @property
    def scale_factor(self) -> float:
        """Logical / physical bytes: how much the scheduler's logical KV budget is scaled up."""
        return self.device_bytes_no_reuse / self.device_bytes if self.device_bytes else 1.0

    @property
    def device_ratio(self) -> float:
        """Physical / logical device bytes (≈ (I + B) / N when all layers share one spec)."""
        return self.device_bytes / self.device_bytes_no_reuse if self.device_bytes_no_reuse else 1.0


@dataclass(frozen=True)
class BufferPlan:
    """Slots in order of their first layer; ``slots[s]`` lists the layers that share slot ``s``."""

    layout: KVLayout
    slots: tuple[tuple[int, ...], ...]
    independent_layers: frozenset[int]
    num_shared_buffers: int

    @classmethod
    def build(cls, layout: KVLayout, num_shared_buffers: int | None, independent_layers: Iterable[int]) -> BufferPlan:
        """Plan for ``B = num_shared_buffers`` (None = one buffer per layer: no reuse).

        ``independent_layers`` are resolved physical indices (see
        ``kvcore.config.prefill_settings.resolve_independent_layers``).
        """
        n = layout.num_layers
        b = n if num_shared_buffers is None else num_shared_buffers
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"num_shared_buffers: got {num_shared_buffers!r}; must be an int >= 1")
        independent = frozenset(independent_layers)
        bad = sorted(i for i in independent if not 0 <= i < n)
        if bad:
            raise ValueError(f"independent_layers: {bad} outside the physical layers 0..{n - 1}")
        slots: list[tuple[int, ...]] = [(i,) for i in sorted(independent)]
        buckets: dict[CacheSpec, list[int]] = {}
        for layer in layout.layers:
            if layer.index not in independent:
                buckets.setdefault(layer.main, []).append(layer.index)
        for members in buckets.values():
            k = min(b, len(members))
            slots.extend(tuple(members[j::k]) for j in range(k))
        slots.sort(key=lambda s: s[0])
        return cls(layout, tuple(slots), independent, b)

    @cached_property
    def layer_to_slot(self) -> dict[int, int]:
        return {layer: s for s, layers in enumerate(self.slots) for layer in layers}

    @property
    def num_logical_layers(self) -> int:
        return self.layout.num_layers

    @property
    def num_buffers(self) -> int:
        """Physical slots (I + Σ min(B, |bucket|))."""
        return len(self.slots)

    @property
    def reuses(self) -> bool:
        return self.num_buffers < self.num_logical_layers

    def previous_occupant(self, layer: int) -> int | None:
        """The layer that used ``layer``'s slot just before it in a forward pass (None if first)."""
        members = self.slots[self.slot_of(layer)]
        i = members.index(layer)
        return members[i - 1] if i else None

    def slot_of(self, layer: int) -> int:
        if layer not in self.layer_to_slot:
            raise ValueError(f"layer {layer} is not in the plan (physical layers 0..{self.num_logical_layers - 1})")
        return self.layer_to_slot[layer]

    @cached_property
    def descriptors(self) -> tuple[Descriptor, ...]:
        """One main tensor per slot plus one indexer tensor where any of its layers has one."""
        out = []
        for s, members in enumerate(self.slots):
            specs = [self.layout.layers[i] for i in members]
            out.append(Descriptor(s, "main", members, specs[0].main))
            indexers = [spec.indexer for spec in specs if spec.indexer is not None]
            if indexers:
                widest = max(indexers, key=lambda c: c.row_bytes)
                out.append(Descriptor(s, "indexer", members, widest))
        return tuple(out)

    @property
    def num_descriptors_before(self) -> int:
        """Logical caches: one per layer, plus one per indexer."""
        return sum(layer.num_caches for layer in self.layout.layers)

    @property
    def num_descriptors_after(self) -> int:
        return len(self.descriptors)

    def log_line(self) -> str:
        return (
            f"Layerwise KV cache reuse merged {self.num_descriptors_before} descriptors into "
            f"{self.num_descriptors_after} descriptors using {self.num_buffers} buffer assignments."
        )

    def log(self) -> None:
        """Emit the plan line once (the line users grep for)."""
        log.info(self.log_line(), slots=[list(s) for s in self.slots])

    def accounting(self, num_blocks: int) -> MemoryAccounting:
        """Device bytes when each buffer holds ``num_blocks`` blocks of ``layout.block_size`` tokens."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        bs = self.layout.block_size
        physical = sum(d.nbytes(num_blocks, bs) for d in self.descriptors)
        logical = num_blocks * bs * self.layout.bytes_per_token
        return MemoryAccounting(num_blocks, physical, logical)

    def host_bytes_needed(self, num_tokens: int) -> int:
        """Host-pool bytes that hold the full logical KV (every cache of every layer) of ``num_tokens``."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        bs = self.layout.block_size
        return -(-num_tokens // bs) * bs * self.layout.bytes_per_token
