"""The hot cache's Python reference path: the executable form of ``kvcore.hotcache.cache``'s exact semantics.

``HotCache(..., native=False)`` runs this path; the native C++/OpenMP path must produce identical
outputs (the property tests compare them). It runs one call at a time, under the cache's lock.
The list policies (``"lru"``, ``"slru"``) keep ``_LayerState``; ``"clock"`` keeps ``_ClockState``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kvcore.hotcache.resolution import MAX_TOKEN, Resolution


class _LayerState:
    """Reference state of one (request, layer)."""

    __slots__ = ("slot_token", "token_slot", "probation", "protected", "resident_bound")

    def __init__(self, capacity: int) -> None:
        self.slot_token = [-1] * capacity  # slot -> token, -1 = empty
        self.token_slot: dict[int, int] = {}
        self.probation: OrderedDict[int, None] = OrderedDict.fromkeys(range(capacity))  # first = least recent
        self.protected: OrderedDict[int, None] = OrderedDict()
        self.resident_bound = 0  # every resident token < resident_bound

    def move(self, slot: int, to: OrderedDict[int, None], *, last: bool = True) -> None:
        """``slot`` to one end of list ``to`` (out of whichever list held it)."""
        self.probation.pop(slot, None)
        self.protected.pop(slot, None)
        to[slot] = None
        to.move_to_end(slot, last=last)

    def empty(self, slot: int) -> None:
        del self.token_slot[self.slot_token[slot]]
        self.slot_token[slot] = -1
        self.move(slot, self.probation, last=False)


class _ClockState:
    """Reference state of one (request, layer) under ``"clock"``: per slot a reference bit, one hand."""

    __slots__ = ("slot_token", "token_slot", "ref", "hand", "resident_bound")

    def __init__(self, capacity: int) -> None:
        self.slot_token = [-1] * capacity  # slot -> token, -1 = empty
        self.token_slot: dict[int, int] = {}
        self.ref = [False] * capacity  # slot -> reference bit
        self.hand = 0
        self.resident_bound = 0  # every resident token < resident_bound

    def empty(self, slot: int) -> None:
        del self.token_slot[self.slot_token[slot]]
        self.slot_token[slot] = -1
        self.ref[slot] = False

    def victim(self, selected: set[int]) -> int:
        """The slot the hand takes: it skips slots selected in this step (unchanged), clears set
        bits, stops at the first other slot whose bit is clear; the hand moves past it."""
        while True:
            s = self.hand
            self.hand = (s + 1) % len(self.slot_token)
            if s in selected:
                continue
            if self.ref[s]:
                self.ref[s] = False
                continue
            return s


_State = _LayerState | _ClockState


class ReferencePath:
    """Straightforward Python path: the executable form of ``kvcore.hotcache.cache``'s docstring."""

    def __init__(self, capacity: int, num_layers: int, lock: threading.Lock, policy: str) -> None:
        self.capacity = capacity
        self.num_layers = num_layers
        self._lock = lock
        self.policy = policy
        self.requests: dict[str, list[_State | None]] = {}

    def resolve(self, layer: int, ids: list[str], topk: torch.Tensor, stable: list[int]) -> Resolution:
        with self._lock:  # the reference is serial: one call at a time
            return self._resolve(layer, ids, topk, stable)

    def _resolve(self, layer: int, ids: list[str], topk: torch.Tensor, stable: list[int]) -> Resolution:
        rows, k = topk.shape
        table, lens = topk.tolist(), stable
        for r in range(rows):  # validate everything before changing anything
            if lens[r] < 0:
                raise ValueError(f"stable_lens[{r}] = {lens[r]} must be >= 0")
            for j, t in enumerate(table[r]):
                if t < -1:
                    raise ValueError(f"topk[{r}, {j}] = {t} is not a token index (>= 0) or -1 padding")
                if t > MAX_TOKEN:
                    raise ValueError(f"topk[{r}, {j}] = {t} exceeds the largest supported token index {MAX_TOKEN}")
        slots = [[-1] * k for _ in range(rows)]
        misses: list[tuple[int, int, int]] = []
        hits = 0
        for r, rid in enumerate(ids):
            layers = self.requests.setdefault(rid, [None] * self.num_layers)
            if self.policy == "clock":
                cst = layers[layer] = layers[layer] or _ClockState(self.capacity)
                assert isinstance(cst, _ClockState)
                hits += self._clock_step(cst, table[r], lens[r], r, slots[r], misses)
            else:
                st = layers[layer] = layers[layer] or _LayerState(self.capacity)
                assert isinstance(st, _LayerState)
                hits += self._step(st, table[r], lens[r], r, slots[r], misses, self.policy == "slru")
        return Resolution(
            slots=torch.tensor(slots, dtype=torch.int32).reshape(rows, k),
            miss_rows=torch.tensor([m[0] for m in misses], dtype=torch.int32),
            miss_tokens=torch.tensor([m[1] for m in misses], dtype=torch.int64),
            miss_slots=torch.tensor([m[2] for m in misses], dtype=torch.int32),
            num_hits=hits,
            num_misses=len(misses),
        )

    @staticmethod
    def _step(
        st: _LayerState,
        toks: list[int],
        stable: int,
        row: int,
        out: list[int],
        misses: list[tuple[int, int, int]],
        slru: bool,
    ) -> int:
        if stable < st.resident_bound:  # (1) drop tokens >= stable
            for s, t in enumerate(st.slot_token):
                if t >= stable:
                    st.empty(s)
        touched: set[int] = set()
        hit_list = st.protected if slru else st.probation
        for j, t in enumerate(toks):  # (2) hits
            s = st.token_slot.get(t, -1) if t >= 0 else -1
            out[j] = s
            if s >= 0 and s not in touched:
                touched.add(s)
                st.move(s, hit_list)
        hits = len(touched)
        spec = []
        for j, t in enumerate(toks):  # (3) misses
            if out[j] >= 0 or t < 0:
                continue
            s = st.token_slot.get(t, -1)
            if s < 0:
                s = next(iter(st.probation), -1)
                if s < 0 or s in touched:  # (only "slru" can get here)
                    s = next(iter(st.protected))
                if st.slot_token[s] >= 0:
                    del st.token_slot[st.slot_token[s]]
                st.slot_token[s] = t
                st.token_slot[t] = s
                st.move(s, st.probation)
                touched.add(s)
                misses.append((row, t, s))
                if t >= stable:
                    spec.append(s)
            out[j] = s
        for s in sorted(spec):  # (4) speculative misses do not stay resident
            st.empty(s)
        st.resident_bound = stable
        return hits

    @staticmethod
    def _clock_step(
        st: _ClockState, toks: list[int], stable: int, row: int, out: list[int], misses: list[tuple[int, int, int]]
    ) -> int:
        if stable < st.resident_bound:  # (1) drop tokens >= stable
            for s, t in enumerate(st.slot_token):
                if t >= stable:
                    st.empty(s)
        selected: set[int] = set()
        for j, t in enumerate(toks):  # (2) hits set their reference bit
            s = st.token_slot.get(t, -1) if t >= 0 else -1
            out[j] = s
            if s >= 0:
                selected.add(s)
                st.ref[s] = True
        hits = len(selected)
        spec = []
        for j, t in enumerate(toks):  # (3) misses take the hand's victim
            if out[j] >= 0 or t < 0:
                continue
            s = st.token_slot.get(t, -1)
            if s < 0:
                s = st.victim(selected)
                if st.slot_token[s] >= 0:
                    del st.token_slot[st.slot_token[s]]
                st.slot_token[s] = t
                st.token_slot[t] = s
                st.ref[s] = False  # a new token's bit starts clear (kvcore.hotcache.cache says why)
                selected.add(s)
                misses.append((row, t, s))
                if t >= stable:
                    spec.append(s)
            out[j] = s
        for s in sorted(spec):  # (4) speculative misses do not stay resident
            st.empty(s)
        st.resident_bound = stable
        return hits

    def resident(self, layer: int, ids: list[str], tokens: torch.Tensor) -> torch.Tensor:
        with self._lock:
            maps = [(self.requests.get(rid) or [None] * self.num_layers)[layer] for rid in ids]
            table = tokens.tolist()
            return torch.tensor(
                [[st is not None and t in st.token_slot for t in row] for st, row in zip(maps, table, strict=True)],
                dtype=torch.bool,
            ).reshape(tokens.shape)

    def finish(self, request_id: str) -> bool:
        with self._lock:
            return self.requests.pop(request_id, None) is not None

    def residency(self, request_id: str, layer: int) -> dict[int, int]:
        layers = self.requests.get(request_id)
        st = layers[layer] if layers else None
        return {} if st is None else dict(st.token_slot)
