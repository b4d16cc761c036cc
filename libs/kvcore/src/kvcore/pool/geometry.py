"""``PoolGeometry``: the shape of a host pool — blocks of ``block_size`` tokens over planes of rows.

One plane per cache per layer (layer i main KV, layer i indexer keys, ...), each ``row_bytes``
per token; ``plane_labels`` may name each plane ``(layer, "main"|"indexer")``. The shared memory
that holds a pool's planes is ``kvcore.pool.segment.SharedSegment``; the object index is the pool's
(``kvcore.pool.host_pool``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # kvcore.layout imports torch; the metastore reads geometries without it
    from kvcore.layout import KVLayout

PLANE_KINDS = ("main", "indexer")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class PoolGeometry:
    """Shape of a pool: ``num_blocks`` blocks of ``block_size`` tokens over ``len(plane_row_bytes)`` planes.

    ``plane_labels`` optionally names each plane ``(layer, "main"|"indexer")`` (see ``plane_index``).
    """

    block_size: int
    plane_row_bytes: tuple[int, ...]
    num_blocks: int
    plane_labels: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "plane_row_bytes", tuple(self.plane_row_bytes))
        object.__setattr__(self, "plane_labels", tuple(tuple(x) for x in self.plane_labels))
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if not self.plane_row_bytes:
            raise ValueError("plane_row_bytes must name at least one plane")
        for p, rb in enumerate(self.plane_row_bytes):
            if not _is_int(rb) or rb < 1:
                raise ValueError(f"plane_row_bytes[{p}] must be an int >= 1, got {rb!r}")
        if not _is_int(self.num_blocks) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {self.num_blocks!r}")
        if self.plane_labels:
            if len(self.plane_labels) != len(self.plane_row_bytes):
                raise ValueError(
                    f"plane_labels has {len(self.plane_labels)} entries for {len(self.plane_row_bytes)} planes"
                )
            for label in self.plane_labels:
                if len(label) != 2 or not _is_int(label[0]) or label[0] < 0 or label[1] not in PLANE_KINDS:
                    raise ValueError(f"plane label {label!r} must be (layer >= 0, one of {PLANE_KINDS})")
            if len(set(self.plane_labels)) != len(self.plane_labels):
                raise ValueError(f"plane_labels must be unique, got {self.plane_labels}")

    @property
    def num_planes(self) -> int:
        return len(self.plane_row_bytes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all planes (one object)."""
        return self.block_size * sum(self.plane_row_bytes)

    @property
    def total_bytes(self) -> int:
        """Data bytes of the whole pool (headers and alignment excluded)."""
        return self.block_bytes * self.num_blocks

    def plane_bytes(self, p: int) -> int:
        return self.num_blocks * self.block_size * self.plane_row_bytes[self.check_plane(p)]

    def check_plane(self, p: int) -> int:
        if not _is_int(p) or not 0 <= p < self.num_planes:
            raise ValueError(f"plane must be an int in [0, {self.num_planes}), got {p!r}")
        return p

    def plane_index(self, layer: int, kind: str = "main") -> int:
        """Plane of ``(layer, kind)``; ValueError if the geometry has no such labelled plane."""
        try:
            return self.plane_labels.index((layer, kind))
        except ValueError:
            raise ValueError(
                f"no plane for (layer={layer!r}, kind={kind!r}); labelled planes: {list(self.plane_labels) or 'none'}"
            ) from None

    @classmethod
    def for_capacity(
        cls,
        block_size: int,
        plane_row_bytes: Sequence[int],
        capacity_bytes: int,
        plane_labels: Sequence[tuple[int, str]] = (),
    ) -> PoolGeometry:
        """As many blocks as fit in ``capacity_bytes`` (``capacity_bytes // block_bytes``)."""
        probe = cls(block_size, tuple(plane_row_bytes), 1, tuple(plane_labels))
        if not _is_int(capacity_bytes) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        num_blocks = capacity_bytes // probe.block_bytes
        if num_blocks == 0:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} holds no block: one block is block_bytes={probe.block_bytes} "
                f"(block_size={block_size} x {sum(probe.plane_row_bytes)} bytes/token over {probe.num_planes} "
                f"planes); raise the capacity to at least {probe.block_bytes}"
            )
        return cls(block_size, probe.plane_row_bytes, num_blocks, probe.plane_labels)

    @classmethod
    def from_layout(cls, layout: KVLayout, capacity_bytes: int, *, include_indexer: bool) -> PoolGeometry:
        """Planes per layer in physical order: its main cache, then its indexer cache (if asked and present)."""
        from kvcore.layout import KVLayout

        if not isinstance(layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(layout).__name__}")
        rows: list[int] = []
        labels: list[tuple[int, str]] = []
        for layer in layout.layers:
            rows.append(layer.main.row_bytes)
            labels.append((layer.index, "main"))
            if include_indexer and layer.indexer is not None:
                rows.append(layer.indexer.row_bytes)
                labels.append((layer.index, "indexer"))
        return cls.for_capacity(layout.block_size, rows, capacity_bytes, labels)

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "plane_row_bytes": list(self.plane_row_bytes),
            "num_blocks": self.num_blocks,
            "plane_labels": [list(x) for x in self.plane_labels],
        }

    @classmethod
    def from_dict(cls, d: dict) -> PoolGeometry:
        try:
            return cls(
                d["block_size"],
                tuple(d["plane_row_bytes"]),
                d["num_blocks"],
                tuple(tuple(x) for x in d.get("plane_labels", ())),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad pool geometry {d!r}: {e}") from None
