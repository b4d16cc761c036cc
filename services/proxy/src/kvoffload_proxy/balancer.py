"""Least-loaded backend choice with load accounting (one `Balancer` per role).

Callers: the request flow and the prefill dispatch, on the event loop only; nothing here blocks,
awaits or does I/O, so no lock is needed.

- `peek(exclude)`: side-effect free; the index `acquire` would pick now.
- `acquire(num_tokens, num_kv_tokens, exclude)`: picks the least-loaded backend, charges the load
  and returns a `Lease`. The lease's holder owns that load until it releases it.
- `Lease.release_tokens()` / `Lease.release_kv()` / `Lease.release()`: idempotent. A prefiller
  lease drops its tokens when the prefill answered and the rest when the decoders pulled the KV;
  a decoder lease is released whole when its request ends. Always `release()` in a `finally:`.

Score = active tokens + kv_weight x active KV tokens (decoders: kv_weight 0, prefillers 0.3).
Ties go to fewer active requests, then to the backend picked least recently (round robin among
idle backends). A min-heap keyed by that tuple holds one live entry per backend; a load change
pushes a fresh entry; stale ones are dropped when they surface or the heap outgrows 4x.
"""
from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .config import Backend


@dataclass
class BackendLoad:
    backend: Backend
    num_active_requests: int = 0
    num_active_tokens: int = 0
    num_active_kv_tokens: int = 0
    last_pick: int = 0


class Balancer:
    def __init__(self, backends: Sequence[Backend], kv_weight: float = 0.0):
        if not backends:
            raise ValueError("a balancer needs at least one backend")
        self.kv_weight = kv_weight
        self.loads = [BackendLoad(b) for b in backends]
        self._version = [0] * len(backends)
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._picks = 0
        for i in range(len(backends)):
            self._push(i)

    def score(self, index: int) -> float:
        load = self.loads[index]
        return load.num_active_tokens + self.kv_weight * load.num_active_kv_tokens

    def peek(self, exclude: Collection[int] = ()) -> int:
        """Least-loaded backend not in `exclude`; if all are excluded, the least-loaded one."""
        skipped = []
        try:
            while self._heap:
                *_, index, version = self._heap[0]
                if version != self._version[index]:
                    heapq.heappop(self._heap)
                elif index in exclude:
                    skipped.append(heapq.heappop(self._heap))
                else:
                    return index
            return skipped[0][3]
        finally:
            for entry in skipped:
                heapq.heappush(self._heap, entry)

    def acquire(self, num_tokens: int, num_kv_tokens: int = 0,
                exclude: Collection[int] = ()) -> Lease:
        if num_tokens < 0 or num_kv_tokens < 0:
            raise ValueError("token counts must be >= 0")
        index = self.peek(exclude)
        self._picks += 1
        self.loads[index].last_pick = self._picks
        self._charge(index, 1, num_tokens, num_kv_tokens)
        return Lease(self, index, num_tokens, num_kv_tokens)

    def _charge(self, index: int, requests: int, tokens: int, kv_tokens: int) -> None:
        load = self.loads[index]
        load.num_active_requests += requests
        load.num_active_tokens += tokens
        load.num_active_kv_tokens += kv_tokens
        assert min(load.num_active_requests, load.num_active_tokens,
                   load.num_active_kv_tokens) >= 0, f"load accounting went negative: {load}"
        self._push(index)

    def _push(self, index: int) -> None:
        self._version[index] += 1
        load = self.loads[index]
        heapq.heappush(self._heap, (self.score(index), load.num_active_requests, load.last_pick,
                                    index, self._version[index]))
        if len(self._heap) > 4 * len(self.loads) + 64:  # drop stale entries that never surface
            self._heap = [e for e in self._heap if e[4] == self._version[e[3]]]
            heapq.heapify(self._heap)

    @property
    def is_idle(self) -> bool:
        return all(l.num_active_requests == 0 and l.num_active_tokens == 0
                   and l.num_active_kv_tokens == 0 for l in self.loads)


class Lease:
    """Load charged to one backend by one request; every release is idempotent."""

    def __init__(self, balancer: Balancer, index: int, num_tokens: int, num_kv_tokens: int):
        self._balancer = balancer
        self.index = index
        self._tokens = num_tokens
        self._kv_tokens = num_kv_tokens
        self._request = 1

    @property
    def backend(self) -> Backend:
        return self._balancer.loads[self.index].backend

    @property
    def is_released(self) -> bool:
        return self._request == 0

    def release_tokens(self) -> None:
        tokens, self._tokens = self._tokens, 0
        if tokens:
            self._balancer._charge(self.index, 0, -tokens, 0)

    def release_kv(self) -> None:
        kv_tokens, self._kv_tokens = self._kv_tokens, 0
        if kv_tokens:
            self._balancer._charge(self.index, 0, 0, -kv_tokens)

    def release(self) -> None:
        if self._request:
            self._request = 0
            tokens, kv_tokens, self._tokens, self._kv_tokens = self._tokens, self._kv_tokens, 0, 0
            self._balancer._charge(self.index, -1, -tokens, -kv_tokens)
