"""Eviction policies of the host pool: which complete objects to drop when ``alloc`` needs room.

The pool tells a policy what happened (``on_complete`` / ``on_access`` / ``on_remove``) and asks it
for ``victims``; the pool alone decides what may be evicted (``can_evict``: complete, unleased, not
in copy) and does the eviction. Policies hold no lock: the pool calls them with its lock held.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable


class EvictionPolicy(ABC):
    """Chooses victims among complete objects. The pool notifies it; ``victims`` has no side effects."""

    @abstractmethod
    def on_complete(self, key: bytes) -> None:
        """The object became complete (evictable unless leased or in copy)."""

    @abstractmethod
    def on_access(self, key: bytes) -> None:
        """A complete object was read or leased."""

    @abstractmethod
    def on_remove(self, key: bytes) -> None:
        """The object was removed, evicted, or became incomplete (being rewritten)."""

    @abstractmethod
    def victims(self, num_needed: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """Up to ``num_needed`` keys, best victim first, each with ``can_evict(key)`` True."""


class LRUEviction(EvictionPolicy):
    """Least-recently-used complete, unleased objects first (the prefill prefix cache)."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_complete(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self, num_needed: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        if num_needed <= 0:
            return []
        return list(itertools.islice((k for k in self._order if can_evict(k)), num_needed))


class NoEviction(EvictionPolicy):
    """Never evict (the decode pool, whose blocks are owned by live requests): full is ``PoolFullError``."""

    def on_complete(self, key: bytes) -> None:
        pass

    def on_access(self, key: bytes) -> None:
        pass

    def on_remove(self, key: bytes) -> None:
        pass

    def victims(self, num_needed: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        return []
