"""``LeaseBook``: the index's read leases by the id their holder got. kvcore's ``LeaseTable`` knows which
keys are leased until when; the book adds the ids (handed out, renewed and released by id) and the
TTL rule a lease request must meet. Not thread-safe: ``MetaStoreCore`` calls it under its lock."""

from __future__ import annotations

import itertools

from kvcore.pool.errors import LeaseExpired
from kvcore.pool.leases import LeaseRecord, LeaseTable, check_ttl_ms

MAX_LEASE_TTL_MS = 86_400_000


def lease_ttl_ms(ttl_ms: int | None, default_ms: int) -> int:
    """The TTL a lease gets: ``default_ms`` for None or 0, else ``ttl_ms`` checked (at most a day)."""
    ttl_ms = default_ms if ttl_ms in (None, 0) else check_ttl_ms(ttl_ms)
    if ttl_ms > MAX_LEASE_TTL_MS:
        raise ValueError(f"ttl_ms must be <= {MAX_LEASE_TTL_MS} (a day), got {ttl_ms}")
    return ttl_ms


class LeaseBook:
    """Live read leases by id; the ids of expired ones are dropped lazily."""

    def __init__(self) -> None:
        self.table = LeaseTable()
        self._by_id: dict[int, LeaseRecord] = {}
        self._ids = itertools.count(1)
        self.dropped = 0  # leases dropped with their pool

    def __len__(self) -> int:
        """Ids held: the live leases and expired ones not dropped yet."""
        return len(self._by_id)

    def __contains__(self, key: bytes) -> bool:
        return key in self.table

    def live(self) -> list[tuple[int, LeaseRecord]]:
        """(id, lease) of every live lease; forgets the ids of the others."""
        live = [(i, lease) for i, lease in self._by_id.items() if lease.live]
        if len(live) != len(self._by_id):
            self._by_id = dict(live)
        return live

    def grant(self, keys: tuple[bytes, ...], deadline: float) -> tuple[int, LeaseRecord]:
        lease = self.table.grant(keys, deadline)
        lease_id = next(self._ids)
        if len(self._by_id) > 2 * self.table.num_live + 64:
            self.live()  # drop ids of expired leases (amortized O(1) per grant)
        self._by_id[lease_id] = lease
        return lease_id, lease

    def live_lease(self, lease_id: int) -> LeaseRecord:
        lease = self._by_id.get(lease_id)
        if lease is None or not lease.live:
            raise LeaseExpired(
                f"lease {lease_id} is not live (expired, released, dropped with its pool, or "
                f"unknown); its objects may be gone: look them up again"
            )
        return lease

    def renew(self, lease_id: int, deadline: float) -> float:
        """The new deadline of a live lease; ``LeaseExpired`` otherwise."""
        return self.table.renew(self.live_lease(lease_id), deadline)

    def release(self, lease_id: int) -> bool:
        """Release a lease; False if it was not live. Idempotent."""
        lease = self._by_id.pop(lease_id, None)
        return lease is not None and self.table.release(lease)

    def drop_touching(self, keys: set[bytes]) -> int:
        """Release every live lease on any of ``keys`` (a pool being dropped); returns how many."""
        dropped = 0
        for lease_id, lease in self.live():
            if any(k in keys for k in lease.keys):
                self.table.release(lease)
                del self._by_id[lease_id]
                dropped += 1
        self.dropped += dropped
        return dropped

    def release_all(self) -> int:
        """Release every live lease and forget every id; returns how many were live."""
        released = 0
        for _, lease in self.live():
            self.table.release(lease)
            released += 1
        self._by_id.clear()
        return released
