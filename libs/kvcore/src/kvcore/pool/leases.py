"""Read leases on host-pool objects: the ``Lease`` protocol every backend's lease handle satisfies,
the plain ``LeaseRecord`` a pool keeps per lease, the ``LeaseTable`` that counts live leases per
key and expires them by deadline, and ``LocalLease``, the handle of an in-process pool.

Hand-off: ``HostPoolBackend.lease`` returns a ``Lease``; the holder releases it (``release()`` or
``with`` exit) or lets it expire. A live lease keeps its objects from being evicted, removed or
rewritten. The table has no lock of its own: its owner calls it with the owner's lock held (a
``LocalLease`` takes that same lock), and that lock is the only place a record's state or deadline
changes. Nothing here knows a pool: the table holds records, not callbacks into its owner.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from kvcore.pool.errors import LeaseExpired

LeaseState = Literal["live", "released", "expired"]


def check_ttl_ms(ttl_ms: object) -> int:
    """``ttl_ms`` if it is an int > 0, else ValueError."""
    if not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool) or ttl_ms <= 0:
        raise ValueError(f"ttl_ms must be an int > 0, got {ttl_ms!r}")
    return ttl_ms


@runtime_checkable
class Lease(Protocol):
    """What the holder of a read lease on ``keys`` may do, whichever backend granted it.

    Until ``deadline`` (``time.monotonic()`` seconds of this process) the objects are neither
    evicted, removed nor rewritten. ``release()`` is idempotent (also on ``with`` exit); ``renew(ttl_ms)``
    moves the deadline to now + ttl_ms and returns it, or raises ``LeaseExpired`` once the lease is
    not live. After expiry, data already copied out stays valid while block ids read before may
    name other objects.
    """

    keys: tuple[bytes, ...]

    @property
    def deadline(self) -> float: ...

    @property
    def live(self) -> bool: ...

    def release(self) -> None: ...

    def renew(self, ttl_ms: int) -> float: ...

    def __enter__(self) -> Lease: ...

    def __exit__(self, *exc: object) -> None: ...


@dataclass(eq=False)
class LeaseRecord:
    """One lease as its pool keeps it: the keys, the deadline (the owner's clock) and the state."""

    keys: tuple[bytes, ...]
    deadline: float
    state: LeaseState = "live"

    @property
    def live(self) -> bool:
        return self.state == "live"


class LeaseTable:
    """Live leases of one pool: per-key counts, a deadline heap, and live/expired totals.

    Call every method with the owner's lock held. Expiry is lazy: the owner calls ``expire(now)``
    at the start of each operation. A renewed record leaves its old heap entry behind; ``expire``
    skips entries whose deadline no longer matches the record's.
    """

    def __init__(self) -> None:
        self._count: dict[bytes, int] = {}
        self._heap: list[tuple[float, int, LeaseRecord]] = []
        self._seq = itertools.count()
        self.num_live = 0
        self.num_expired = 0

    def __contains__(self, key: bytes) -> bool:
        """True while at least one live lease covers ``key``."""
        return key in self._count

    def count(self, key: bytes) -> int:
        """Live leases covering ``key``."""
        return self._count.get(key, 0)

    def grant(self, keys: tuple[bytes, ...], deadline: float) -> LeaseRecord:
        """A new live record on ``keys`` until ``deadline``."""
        record = LeaseRecord(keys, deadline)
        for k in keys:
            self._count[k] = self._count.get(k, 0) + 1
        self.num_live += 1
        heapq.heappush(self._heap, (deadline, next(self._seq), record))
        return record

    def expire(self, now: float) -> None:
        """Expire every live record whose deadline is at or before ``now``."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, record = heapq.heappop(heap)
            if record.live and record.deadline == deadline:
                record.state = "expired"
                self._drop_counts(record)
                self.num_expired += 1

    def release(self, record: LeaseRecord) -> bool:
        """Mark a live record released; False if it was not live (idempotent)."""
        if not record.live:
            return False
        record.state = "released"
        self._drop_counts(record)
        return True

    def renew(self, record: LeaseRecord, deadline: float) -> float:
        """Move a live record's deadline to ``deadline`` and return it; ``LeaseExpired`` if not live."""
        if not record.live:
            raise LeaseExpired(
                f"lease on {len(record.keys)} key(s) is {record.state}; its objects may be gone",
                key=record.keys[0] if record.keys else None,
            )
        record.deadline = deadline
        heapq.heappush(self._heap, (deadline, next(self._seq), record))
        return deadline

    def _drop_counts(self, record: LeaseRecord) -> None:
        self.num_live -= 1
        for k in record.keys:
            c = self._count[k] - 1
            if c:
                self._count[k] = c
            else:
                del self._count[k]


class LocalLease:
    """The ``Lease`` handle of an in-process pool: a record in that pool's ``LeaseTable``, reached
    under the pool's lock. ``clock`` is the table's clock (``time.monotonic`` by default)."""

    def __init__(
        self,
        record: LeaseRecord,
        table: LeaseTable,
        lock: threading.Lock | threading.Condition,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keys = record.keys
        self._record, self._table, self._lock, self._clock = record, table, lock, clock

    @property
    def deadline(self) -> float:
        return self._record.deadline

    @property
    def live(self) -> bool:
        with self._lock:
            self._table.expire(self._clock())
            return self._record.live

    def release(self) -> None:
        with self._lock:
            self._table.expire(self._clock())
            self._table.release(self._record)

    def renew(self, ttl_ms: int) -> float:
        check_ttl_ms(ttl_ms)
        with self._lock:
            now = self._clock()
            self._table.expire(now)
            return self._table.renew(self._record, now + ttl_ms / 1000)

    def __enter__(self) -> LocalLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"LocalLease({len(self.keys)} keys, {self._record.state}, deadline={self._record.deadline:.3f})"
