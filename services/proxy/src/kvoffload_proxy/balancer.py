"""Least-loaded backend choice with load accounting (one `Balancer` per role).

Callers: the request flow and the prefill dispatch, on the event loop only; nothing here blocks,
awaits or does I/O, so no lock is needed.

- `peek(exclude)`: side-effect free; the index `acquire` would pick now.
- `acquire(num_tokens, num_kv_tokens, exclude)`: picks the least-loaded backend, charges the load
  and returns a `Lease`. The lease's holder owns that load until it releases it.
- `Lease.release_tokens()` / `Lease.release_kv()` / `Lease.release()`: idempotent. A prefiller
  lease drops its tokens when the prefill answered and the rest when the decoders pulled the KV;
  a decoder lease is released whole when its request ends. Always `release()` in a `finally:`.

Prefillers: score = active tokens + kv_weight x active KV tokens (kv_weight 0.3); ties go to fewer
active requests. Decoders (``by_queue``): queue depth first — the requests this proxy has in flight
on the decoder (its own accounting: exact for one proxy, never stale) — then the most free host-pool
bytes the decoder last reported (``X-Decode-Load`` header on every decoder answer, `report`), then
active tokens. Either way the last tie goes to the backend picked least recently (round robin among
idle backends). A decoder that answered 429 (queue full) is `mark_full` until its Retry-After has
passed; `full()` lists those, which `upstream.post` tries last. A min-heap keyed by that tuple holds
one live entry per backend; a load change pushes a fresh entry; stale ones are dropped when they
surface or the heap outgrows 4x.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from .config import Backend

_HeapEntry = tuple[tuple[float, ...], int, int, int]  # (key, last pick, backend index, version)


@dataclass
class BackendLoad:
    backend: Backend
    num_active_requests: int = 0
    num_active_tokens: int = 0
    num_active_kv_tokens: int = 0
    last_pick: int = 0
    reported: dict[str, int] = field(default_factory=dict)  # the decoder's last X-Decode-Load
    full_until: float = 0.0  # monotonic time until which a decoder that answered 429 counts as full
    rejections: int = 0  # 429 answers from this backend


def parse_load(header: str | None) -> dict[str, int]:
    """``queued=3;running=2;free_pool_bytes=123`` -> dict; malformed parts are ignored."""
    out: dict[str, int] = {}
    for part in (header or "").split(";"):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            continue
    return out


class Balancer:
    def __init__(self, backends: Sequence[Backend], kv_weight: float = 0.0, by_queue: bool | None = None):
        if not backends:
            raise ValueError("a balancer needs at least one backend")
        self.kv_weight = kv_weight
        self.by_queue = backends[0].role == "decoder" if by_queue is None else by_queue
        self.loads = [BackendLoad(b) for b in backends]
        self._version = [0] * len(backends)
        self._heap: list[_HeapEntry] = []
        self._picks = 0
        for i in range(len(backends)):
            self._push(i)

    def score(self, index: int) -> float:
        load = self.loads[index]
        return load.num_active_tokens + self.kv_weight * load.num_active_kv_tokens

    def key(self, index: int) -> tuple[float, ...]:
        """The heap order (least first), without the round-robin tie-break."""
        load = self.loads[index]
        if self.by_queue:
            return (load.num_active_requests, -load.reported.get("free_pool_bytes", 0), self.score(index))
        return (self.score(index), load.num_active_requests)

    def report(self, index: int, load: dict[str, int]) -> None:
        """A decoder's self-reported load (its ``X-Decode-Load`` header)."""
        if load and load != self.loads[index].reported:
            self.loads[index].reported = load
            self._push(index)

    def mark_full(self, index: int, retry_after_s: float) -> None:
        """The backend answered 429: try it last until ``retry_after_s`` has passed."""
        load = self.loads[index]
        load.rejections += 1
        load.full_until = max(load.full_until, time.monotonic() + retry_after_s)

    def full(self) -> set[int]:
        now = time.monotonic()
        return {i for i, load in enumerate(self.loads) if load.full_until > now}

    def peek(self, exclude: Collection[int] = ()) -> int:
        """Least-loaded backend not in `exclude`; if all are excluded, the least-loaded one."""
        skipped: list[_HeapEntry] = []
        try:
            while self._heap:
                *_, index, version = self._heap[0]
                if version != self._version[index]:
                    heapq.heappop(self._heap)
                elif index in exclude:
                    skipped.append(heapq.heappop(self._heap))
                else:
                    return index
            return skipped[0][-2]
        finally:
            for entry in skipped:
                heapq.heappush(self._heap, entry)

    def acquire(self, num_tokens: int, num_kv_tokens: int = 0, exclude: Collection[int] = ()) -> Lease:
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
        assert min(load.num_active_requests, load.num_active_tokens, load.num_active_kv_tokens) >= 0, (
            f"load accounting went negative: {load}"
        )
        self._push(index)

    def _push(self, index: int) -> None:
        self._version[index] += 1
        load = self.loads[index]
        heapq.heappush(self._heap, (self.key(index), load.last_pick, index, self._version[index]))
        if len(self._heap) > 4 * len(self.loads) + 64:  # drop stale entries that never surface
            self._heap = [e for e in self._heap if e[-1] == self._version[e[-2]]]
            heapq.heapify(self._heap)

    @property
    def is_idle(self) -> bool:
        return all(
            load.num_active_requests == 0 and load.num_active_tokens == 0 and load.num_active_kv_tokens == 0
            for load in self.loads
        )


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
