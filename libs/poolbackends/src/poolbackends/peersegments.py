"""Other pools' segments on this host, as ``RemoteHostPool.get_into`` reads their objects: a pool is
read only when it is on this host and has this pool's planes; its segment is attached by name once
and cached, attached again when it was recreated under that name, and closed with the pool."""

from __future__ import annotations

import os
import threading

import torch

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import ObjectNotFound, PoolError
from kvcore.pool.segment import SharedSegment
from poolbackends.records import PoolRecord


class PeerSegments:
    """The segments of the pools ``pool_id`` (on ``host_id``, planes of ``geometry``) reads from."""

    def __init__(self, pool_id: str, host_id: str, geometry: PoolGeometry) -> None:
        self.pool_id, self.host_id, self.geometry = pool_id, host_id, geometry
        self._lock = threading.Lock()
        self._attached: dict[str, tuple[str, tuple[int, int], SharedSegment]] = {}  # pool -> (name, inode, seg)

    def plane(self, record: PoolRecord | None, pool_id: str, plane: int, key: bytes) -> torch.Tensor:
        """Plane ``plane`` of another pool's segment on this host (attached once, re-attached if replaced)."""
        if record is None:
            raise ObjectNotFound(f"object {key!r}: its pool {pool_id!r} is no longer registered", key=key)
        if record.host != self.host_id:
            raise PoolError(
                f"object {key!r} lives in pool {pool_id!r} on host {record.host!r}, and this process is on "
                f"{self.host_id!r}: the cross-host data path is not available for the pool (RemoteHostPool "
                f"reads other pools through same-host shared memory only)",
                key=key,
            )
        g, mine = record.geometry, self.geometry
        if (g.block_size, g.plane_row_bytes, g.plane_labels) != (
            mine.block_size,
            mine.plane_row_bytes,
            mine.plane_labels,
        ):
            raise PoolError(
                f"object {key!r} lives in pool {pool_id!r} whose planes ({g}) differ from pool "
                f"{self.pool_id!r}'s ({mine}): plane {plane} would mean another cache",
                key=key,
            )
        path = SharedSegment.path_for(record.segment_name)
        with self._lock:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise ObjectNotFound(
                    f"object {key!r}: segment {path} of pool {pool_id!r} is gone (its LocalService exited)", key=key
                ) from None
            inode = (st.st_dev, st.st_ino)
            entry = self._attached.get(pool_id)
            if entry is None or entry[:2] != (record.segment_name, inode):  # new, or recreated under the name
                if entry is not None:
                    entry[2].close()
                seg = SharedSegment.attach(record.segment_name)
                if seg.geometry != g:
                    seg.close()
                    raise PoolError(
                        f"segment {path} has geometry {seg.geometry}, but pool {pool_id!r} registered {g}", key=key
                    )
                entry = self._attached[pool_id] = (record.segment_name, inode, seg)
            return entry[2].plane(plane)

    def close(self) -> None:
        with self._lock:
            attached, self._attached = list(self._attached.values()), {}
        for _, _, seg in attached:
            seg.close()
