"""``FetchedObjects``: whole objects a ``StoreHostPool`` read from its store, kept for the other planes of
the same load.

A store object is a whole block, every plane in one (``poolbackends.storepool``), but a layerwise load
reads it plane by plane: layer 0's rows of every hit block, then layer 1's, ... Without this, each
plane's ``get_into`` fetched every object whole again (a 30-layer model moved 30 times its hit over
the network). Here an object read for plane p is kept until each of its other planes was read once,
then dropped; a key's bytes never change (keys are content hashes and planes are written once), so a
kept copy is the store's (the pool still checks that the object exists before it reads a kept copy:
one ``exists`` call instead of a fetch). Bounded: at most ``max_bytes`` (the oldest dropped first) and ``ttl_s``
seconds (a load that stopped halfway leaves nothing behind for long). Thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class _Kept:
    row: torch.Tensor  # [block_bytes] uint8: the whole object
    planes_left: set[int]
    at: float


class FetchedObjects:
    """Objects (rows of ``block_bytes``) of a pool of ``num_planes`` planes, kept per key."""

    def __init__(self, num_planes: int, max_bytes: int, ttl_s: float = 60.0) -> None:
        self.num_planes, self.max_bytes, self.ttl_s = num_planes, max_bytes, ttl_s
        self._kept: OrderedDict[bytes, _Kept] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, keys: Sequence[bytes], plane: int) -> dict[bytes, torch.Tensor] | None:
        """Every object of ``keys`` (key -> whole row), each marked read for ``plane``, or None unless
        all are kept (a load fetches its objects together: one store read, one failure for all). An
        object whose every plane has been read is dropped (the row returned stays valid)."""
        with self._lock:
            self._expire(time.monotonic())
            if not all(k in self._kept for k in keys):
                return None
            out: dict[bytes, torch.Tensor] = {}
            for k in keys:
                kept = self._kept[k]
                out[k] = kept.row
                kept.planes_left.discard(plane)
                if not kept.planes_left:
                    self._drop(k)
        return out

    def keep(self, keys: Sequence[bytes], rows: torch.Tensor, plane: int) -> None:
        """Keep the objects just fetched for ``plane`` (``rows[i]`` is ``keys[i]``'s) for their other planes."""
        if self.num_planes < 2 or not len(keys):
            return
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            for k, row in zip(keys, rows, strict=True):
                if k in self._kept:
                    self._drop(k)  # fetched again: the new copy's planes count
                if row.numel() > self.max_bytes:
                    continue
                while self._kept and self._bytes + row.numel() > self.max_bytes:
                    self._drop(next(iter(self._kept)))
                self._kept[k] = _Kept(row, set(range(self.num_planes)) - {plane}, now)
                self._bytes += row.numel()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def _expire(self, now: float) -> None:
        while self._kept:
            k, kept = next(iter(self._kept.items()))
            if now - kept.at < self.ttl_s:
                return
            self._drop(k)

    def _drop(self, key: bytes) -> None:
        self._bytes -= self._kept.pop(key).row.numel()
