"""``StoreObjects``: how one ``MooncakeHostPool``'s objects live in Mooncake Store.

Memory. The pool's blocks live in its ``kvcore.pool.segment.SharedSegment`` (plane p a
``[num_blocks, block_size, row_bytes_p]`` region); the whole mapping is registered with the store
client, so puts are zero-copy. Objects. A complete object is ONE Mooncake object, key
``<namespace>/<key hex>``, bytes = the block's rows of plane 0, then plane 1, ...
(``part_bytes[p] = block_size * row_bytes_p`` each), put from the planes in place. Sentinel.
``<namespace>/.pool-<pool id>`` holds the segment's first ``HEADER_BYTES``; while it exists, the
master still has this pool's objects (a restarted master has none). Every call here is one batch
of store calls (split at 1024 keys by ``MooncakeStore``); the pool's lock is the caller's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from kvcore.pool.host_pool import ObjectNotFound, PoolError
from kvcore.pool.segment import SharedSegment
from poolbackends.mooncake_store import (
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    MooncakeObjectsUnreachable,
    MooncakeStore,
    MooncakeStoreError,
    code_name,
)

log = structlog.get_logger(__name__)

HEADER_BYTES = 64  # the sentinel object's bytes: the start of the segment's header


@dataclass(frozen=True)
class Removal:
    """What a non-forced batch remove did: ``removed`` keys, ``leased`` ones (Mooncake's lease:
    a reader elsewhere checked or read them lately), and the first other ``error`` (None if none)."""

    removed: list[bytes]
    leased: list[bytes]
    error: MooncakeStoreError | None


class StoreObjects:
    """One pool's registered segment and its objects' keys and bytes in the store."""

    def __init__(self, store: MooncakeStore, segment: SharedSegment, namespace: str, pool_id: str) -> None:
        g = segment.geometry
        self.store, self.geometry, self.namespace, self.pool_id = store, g, namespace, pool_id
        self.part_bytes = [g.block_size * rb for rb in g.plane_row_bytes]  # per object, per plane
        planes = [segment.plane(p) for p in range(g.num_planes)]
        self._part_base = torch.tensor([t.data_ptr() for t in planes], dtype=torch.long)  # [num_planes]
        self._part_stride = torch.tensor(self.part_bytes, dtype=torch.long)  # [num_planes]
        self._base = planes[0].data_ptr() - segment.plane_offsets[0]  # the mapping's start (its header)
        self.sentinel = f"{namespace}/.pool-{pool_id}"
        store.register(self._base, segment.size_bytes)

    def key(self, key: bytes) -> str:
        return f"{self.namespace}/{key.hex()}"

    def fail(self, op: str, code: int, key: bytes | None, what: str = "") -> MooncakeStoreError:
        return MooncakeStoreError(self.failure(op, code, what), code=code, key=key)

    def failure(self, op: str, code: int, what: str = "") -> str:
        """What ``fail`` says: the operation, ``what`` it was about, the code, the master and the pool."""
        return (
            f"Mooncake Store {op} {what}failed with {code_name(code)} (master {self.store.master}, pool "
            f"{self.pool_id[:8]}, namespace {self.namespace!r})"
        )

    # ---- the sentinel --------------------------------------------------------------------------

    def put_sentinel(self) -> None:
        code = self.store.put_parts([self.sentinel], [[self._base]], [[HEADER_BYTES]])[0]
        if code != 0:
            raise self.fail("put", code, None, f"of pool sentinel {self.sentinel!r} ")

    def sentinel_present(self) -> bool:
        code = self.store.exists([self.sentinel])[0]
        if code < 0:
            raise self.fail("exists", code, None, "of the pool sentinel ")
        return code == 1

    # ---- objects -------------------------------------------------------------------------------

    def put(self, keys: list[bytes], ids: list[int]) -> None:
        """Put objects ``keys`` from blocks ``ids``, all or none (``MooncakeStoreError``). A key the
        store holds already is a silent no-op in this Mooncake (the first put wins)."""
        if not keys:
            return
        ptrs = self._part_base[None, :] + torch.tensor(ids, dtype=torch.long)[:, None] * self._part_stride[None, :]
        codes = self.store.put_parts([self.key(k) for k in keys], ptrs.tolist(), [self.part_bytes] * len(keys))
        bad = next((i for i, c in enumerate(codes) if c != 0), None)
        if bad is not None:
            done = [self.key(k) for k, c in zip(keys, codes) if c == 0]
            if done:
                self.store.remove(done, force=True)
            raise self.fail("put", codes[bad], keys[bad], f"of {len(keys)} object(s) (none written) ")

    def remove(self, keys: list[bytes]) -> Removal:
        """Remove objects without force (a leased one stays; a missing one counts as done)."""
        if not keys:
            return Removal([], [], None)
        codes = self.store.remove([self.key(k) for k in keys])
        bad = next((i for i, c in enumerate(codes) if c not in (0, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)), None)
        return Removal(
            [k for k, c in zip(keys, codes) if c == 0],
            [k for k, c in zip(keys, codes) if c == OBJECT_HAS_LEASE],
            None if bad is None else self.fail("remove", codes[bad], keys[bad], f"of {len(keys)} object(s) "),
        )

    def exists(self, keys: list[bytes], op: str) -> list[bool]:
        """Which keys are complete in the store; the master leases those that are (``op`` names the caller)."""
        if not keys:
            return []
        codes = self.store.exists([self.key(k) for k in keys])
        bad = next((i for i, c in enumerate(codes) if c < 0), None)
        if bad is not None:
            raise self.fail(f"exists (for {op})", codes[bad], keys[bad])
        return [c == 1 for c in codes]

    def touch(self, skeys: list[str]) -> None:
        """Extend Mooncake's lease on store keys (a check is what grants it); missing keys are skipped."""
        if skeys:
            self.store.exists(skeys)

    def read_into(self, keys: list[bytes], staging: torch.Tensor) -> None:
        """Read whole objects ``keys`` (distinct) into the rows of ``staging`` (``[len(keys), block_bytes]``
        uint8); ``ObjectNotFound`` for a missing key, ``PoolError`` for one of another geometry."""
        g = self.geometry
        base = staging.data_ptr()
        registered = self.store.protocol != "tcp"  # TCP reads land in any memory; RDMA needs it registered
        if registered:
            self.store.register(base, staging.numel())
        try:
            codes = self.store.get_into(
                [self.key(k) for k in keys],
                [base + i * g.block_bytes for i in range(len(keys))],
                [g.block_bytes] * len(keys),
            )
        finally:
            if registered:
                self.store.unregister(base)
        unreachable = [k for k, c in zip(keys, codes) if c == TRANSFER_FAIL]
        if unreachable:
            raise self._drop_unreachable(unreachable, len(keys))
        for k, c in zip(keys, codes):
            if c == OBJECT_NOT_FOUND:
                raise ObjectNotFound(f"no object for key {k!r} in this pool or in Mooncake Store", key=k)
            if c < 0:
                raise self.fail("get", c, k, f"of {len(keys)} object(s) ")
            if c != g.block_bytes:
                raise PoolError(
                    f"object {k!r} in Mooncake Store has {c} B, but this pool's objects have "
                    f"{g.block_bytes} B ({g}): it was written with another geometry",
                    key=k,
                )

    def _drop_unreachable(self, keys: list[bytes], batch: int) -> MooncakeObjectsUnreachable:
        """Objects whose bytes could not be transferred: their owner's segment does not answer (its
        process died; the master lists its objects until its ``--client_ttl``). They are removed
        from the store (forced: nobody can read them), so the next ``exists`` misses them and the
        caller computes them again instead of failing on them until the master notices; a removal
        that fails is logged, not raised. The error to raise for this read, naming it all."""
        codes = self.store.remove([self.key(k) for k in keys], force=True)
        dropped = sum(c in (0, OBJECT_NOT_FOUND) for c in codes)
        log.warning(
            "mooncake_unreachable_objects_dropped",
            pool=self.pool_id[:8],
            namespace=self.namespace,
            objects=len(keys),
            dropped=dropped,
            remove_errors=sorted({code_name(c) for c in codes if c not in (0, OBJECT_NOT_FOUND)}),
        )
        what = (
            f"of {len(keys)} of {batch} object(s) (their owner's segment does not answer: its process is gone or "
            f"unreachable; {dropped} removed from the store, so whoever asks next computes them again) "
        )
        return MooncakeObjectsUnreachable(self.failure("get", TRANSFER_FAIL, what), code=TRANSFER_FAIL, key=keys[0])

    def drop_all(self, keys: list[bytes]) -> None:
        """Force-remove ``keys`` and the sentinel (the pool is closing); errors are the caller's to log."""
        codes = self.store.remove([self.key(k) for k in keys] + [self.sentinel], force=True)
        bad = next((c for c in codes if c not in (0, OBJECT_NOT_FOUND)), None)
        if bad is not None:
            raise self.fail("remove", bad, None, f"of the closing pool's {len(keys)} object(s) ")

    def close(self) -> None:
        self.store.unregister(self._base)
