"""Read leases on host-pool objects: the ``Lease`` a caller holds, and the ``LeaseTable`` in which
the pool counts live leases per key and expires them by deadline.

Hand-off: ``HostPoolBackend.lease`` returns a ``Lease``; the holder releases it (``release()`` or
``with`` exit) or lets it expire. A live lease keeps its objects from being evicted, removed or
rewritten. ``LeaseTable`` has no lock of its own: its owner (``LocalHostPool``) calls it with the
pool lock held, and that lock is the only place a lease's state or deadline changes.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcore.hostpool import HostPoolBackend


def check_ttl_ms(ttl_ms: object) -> int:
    """``ttl_ms`` if it is an int > 0, else ValueError."""
    if not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms <= 0:
        raise ValueError(f"ttl_ms must be an int > 0, got {ttl_ms!r}")
    return ttl_ms


class Lease:
    """A read lease on ``keys``: until ``deadline`` (``time.monotonic()`` seconds) the objects are
    neither evicted, removed nor rewritten.

    The holder releases it with ``release()`` (idempotent; also on ``with`` exit) or extends it with
    ``renew(ttl_ms)``. If the deadline passes first, the lease expires (lazily, on the pool's next
    operation): it stops protecting, ``renew`` raises ``LeaseExpired``, and data already copied out
    stays valid while block ids read before may now name other objects.
    """

    def __init__(self, keys: tuple[bytes, ...], deadline: float, pool: "HostPoolBackend") -> None:
        # pool: the backend that granted it; it implements _lease_live/_lease_release/_lease_renew.
        self.keys = keys
        self._deadline = deadline
        self._pool = pool
        self._state = "live"  # live | released | expired; changed only under the pool lock

    @property
    def deadline(self) -> float:
        return self._deadline

    @property
    def live(self) -> bool:
        return self._pool._lease_live(self)

    def release(self) -> None:
        self._pool._lease_release(self)

    def renew(self, ttl_ms: int) -> float:
        """Move the deadline to now + ttl_ms; returns it. ``LeaseExpired`` if no longer live."""
        return self._pool._lease_renew(self, ttl_ms)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Lease({len(self.keys)} keys, {self._state}, deadline={self._deadline:.3f})"


class LeaseTable:
    """Live leases of one pool: per-key counts, a deadline heap, and live/expired totals.

    Call every method with the pool lock held. Expiry is lazy: the pool calls ``expire(now)`` at
    the start of each operation. A renewed lease leaves its old heap entry behind; ``expire``
    skips entries whose deadline no longer matches the lease's.
    """

    def __init__(self) -> None:
        self._count: dict[bytes, int] = {}
        self._heap: list[tuple[float, int, Lease]] = []
        self._seq = itertools.count()
        self.num_live = 0
        self.num_expired = 0

    def __contains__(self, key: bytes) -> bool:
        """True while at least one live lease covers ``key``."""
        return key in self._count

    def count(self, key: bytes) -> int:
        """Live leases covering ``key``."""
        return self._count.get(key, 0)

    def grant(self, keys: tuple[bytes, ...], deadline: float, pool: "HostPoolBackend") -> Lease:
        """A new live lease on ``keys`` until ``deadline`` (callbacks go to ``pool``)."""
        lease = Lease(keys, deadline, pool)
        for k in keys:
            self._count[k] = self._count.get(k, 0) + 1
        self.num_live += 1
        heapq.heappush(self._heap, (lease._deadline, next(self._seq), lease))
        return lease

    def expire(self, now: float) -> None:
        """Expire every live lease whose deadline is at or before ``now``."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, lease = heapq.heappop(heap)
            if lease._state == "live" and lease._deadline == deadline:
                lease._state = "expired"
                self._drop_counts(lease)
                self.num_expired += 1

    def release(self, lease: Lease) -> None:
        """Mark a live lease released. Idempotent (a released or expired lease is left as it is)."""
        if lease._state == "live":
            lease._state = "released"
            self._drop_counts(lease)

    def extend(self, lease: Lease, deadline: float) -> float:
        """Move a live lease's deadline to ``deadline``; returns it. The caller checks it is live."""
        lease._deadline = deadline
        heapq.heappush(self._heap, (deadline, next(self._seq), lease))
        return deadline

    def _drop_counts(self, lease: Lease) -> None:
        self.num_live -= 1
        for k in lease.keys:
            c = self._count[k] - 1
            if c:
                self._count[k] = c
            else:
                del self._count[k]
