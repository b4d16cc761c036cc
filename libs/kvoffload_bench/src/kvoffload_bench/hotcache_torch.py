"""A vectorized torch ``HotCache``: the baseline the hot-cache bench holds the native path against.

``TorchHotCache(capacity, num_layers)`` has ``kvcore.hotcache.HotCache``'s interface, front-end
validation and counters (it is a ``HotCache`` whose implementation is swapped) and exactly its
semantics (module docstring of ``kvcore.hotcache.cache``): same ``Resolution``, same residency, same
ValueErrors, proven against the reference by ``tests/test_hotcache_torch.py``. It exists for the
bench: "native is N x faster than Python" says little, "native is N x faster than the best torch
code of the same semantics" says whether the C++ earns its keep.

Every step is whole-tensor torch ops over all rows and entries at once: no Python loop over rows,
tokens, slots or misses (the only per-row Python is the request-id -> handle dict lookup, as on
the native path). The state of a layer lives in tensors indexed by a per-request handle ``h``:

- ``tok[layer]``: flat int64 ``[1 + handles * C]``, the token in slot ``s`` of handle ``h`` at
  ``1 + h*C + s`` (-1 empty); element 0 is a spare holding -2, which no top-k entry equals;
- ``order[layer]``: ``[handles, C]`` int64, each handle's slots from least to most recent (a
  permutation, so a step's LRU victims are its first columns: no sort);
- ``bound[layer]``: ``[handles]``, the stable length of the last step (every resident token is
  below it, so step 1 runs only where the stable length shrank, the shortcut of both other paths);
- ``map[layer]``: flat int64 ``[handles * T + 1]``, token ``t`` of handle ``h`` at ``h*T + t``
  -> its ``tok`` index (0, the spare, when never placed; the last element is where padding
  looks), a dense map like the native one (``T`` grows past the largest token seen). Entries are
  written when a token is placed and never cleared: a lookup is a hit only if ``tok`` at the
  index still holds the token, so evictions, drops and ``finish`` cost nothing in the map.

One step (rows ``R``, top-k ``k``, capacity ``C``): step 1 (only where a stable length shrank)
empties the slots holding tokens ``>= S`` and moves them to the front of the order; every entry
is looked up (two gathers and a compare); the first occurrence of each token in its row comes from
``scatter_reduce(amin)`` of the column index into a scratch map; hits and misses are first
occurrences that are / are not resident. Hits move to the back of the order in first-occurrence
order and the ``M`` misses take the ``M`` front slots in order and move to the back: a stable
partition plus a rotation by ``M``, done as one scatter of new positions computed with a cumulative
sum. The misses are one ``nonzero`` of the first-occurrence-miss mask (row-major = the reference's
order); their tokens and ``tok`` indices are written with two ``index_put_``, after which a second
map lookup gives every entry's slot (duplicates included). Step 4 (only if a miss is speculative)
empties those slots and moves them to the front.

Calls run one at a time (a lock), each using torch's intra-op threads (``threads`` pins their
number for the call: at the bench's sizes most tensors are below torch's parallel grain, and on a
busy machine one thread can beat two, so the bench times both and keeps the faster). Eager mode:
no ``torch.compile``, which would generate fused C++ loops, i.e. a native path of its own.
"""

from __future__ import annotations

import threading

import torch

from kvcore.hotcache.cache import HotCache
from kvcore.hotcache.resolution import MAX_TOKEN, Resolution

__all__ = ["TorchHotCache"]


TORCH_POLICY = "lru"  # the semantics this implementation has (and the only one)


class TorchHotCache(HotCache):
    """``HotCache`` with the vectorized torch implementation (see module docstring). ``threads``:
    torch intra-op threads while a call runs (``torch.set_num_threads``, restored after it: process
    state, so only for single-threaded callers like the bench); None keeps the process's setting."""

    def __init__(self, capacity: int, num_layers: int, *, threads: int | None = None) -> None:
        super().__init__(capacity, num_layers, native=False, policy=TORCH_POLICY)
        # kvcore.hotcache.cache types _impl as its own two paths; this one has their interface (resolve, resident,
        # finish, residency, requests)
        self._impl = _TorchImpl(self.capacity, self.num_layers, self._lock)  # type: ignore[assignment]
        self.threads = threads

    def resolve(self, layer, request_ids, topk, stable_lens) -> Resolution:
        if self.threads is None:
            return super().resolve(layer, request_ids, topk, stable_lens)
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return super().resolve(layer, request_ids, topk, stable_lens)
        finally:
            torch.set_num_threads(before)

    def stats(self) -> dict[str, float | int | bool | str]:
        return super().stats() | {"impl": "torch"}


def _to_front_desc(order: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
    """``order`` [R, C] (slots, least recent first) with the slots flagged in ``flag`` [R, C]
    (by slot) moved to the least-recent end one by one in ascending slot index, i.e. in front in
    descending index; the others keep their order."""
    n = flag.sum(1, keepdim=True)  # [R, 1]
    rank = n - flag.cumsum(1)  # [R, C]: flagged slots with a larger index
    fp = flag.gather(1, order)  # [R, C] by position
    keep = (~fp).long()
    newpos = torch.where(fp, rank.gather(1, order), n + keep.cumsum(1) - keep)
    return torch.empty_like(order).scatter_(1, newpos, order)


class _TorchImpl:
    def __init__(self, capacity: int, num_layers: int, lock: threading.Lock) -> None:
        self.capacity = capacity
        self.num_layers = num_layers
        self._lock = lock
        self.requests: dict[str, int] = {}  # request id -> handle
        self._free: list[int] = []
        self._handles = 0  # H: allocated handles
        self._width = 1  # T: map columns per handle (> every token placed so far)
        # tok: [L, 1 + H*C]; element 0 is a spare that never equals a top-k value
        self._tok = torch.full((num_layers, 1), -2, dtype=torch.int64)
        self._order = torch.empty(num_layers, 0, capacity, dtype=torch.int64)  # [L, H, C]
        self._bound = torch.empty(num_layers, 0, dtype=torch.int64)  # [L, H]
        self._map = torch.zeros(num_layers, 1, dtype=torch.int64)  # [L, H*T + 1]: index into tok, 0 = none
        self._scratch = torch.zeros(1, dtype=torch.int64)  # [H*T + 1]
        self._arange = torch.arange(capacity)
        self._cols_cache, self._cols_k = torch.empty(0, dtype=torch.int64), 0

    # ---- state management ----------------------------------------------------------------------

    def _resize(self, handles: int, width: int) -> None:
        L, C, H, T = self.num_layers, self.capacity, self._handles, self._width
        if handles > H:
            grow = handles - H
            self._tok = torch.cat([self._tok, torch.full((L, grow * C), -1, dtype=torch.int64)], 1)
            self._order = torch.cat([self._order, self._arange.expand(L, grow, C)], 1)
            self._bound = torch.cat([self._bound, torch.zeros(L, grow, dtype=torch.int64)], 1)
        new_map = torch.zeros(L, handles * width + 1, dtype=torch.int64)
        new_map[:, : handles * width].view(L, handles, width)[:, :H, :T] = self._map[:, : H * T].view(L, H, T)
        self._map = new_map
        self._scratch = torch.zeros(handles * width + 1, dtype=torch.int64)
        self._handles, self._width = handles, width

    def _alloc(self, ids: list[str]) -> None:
        need = len(ids) - len(self._free)
        if need > 0:
            old = self._handles
            self._resize(max(old + need, 2 * old), self._width)
            self._free[:0] = range(self._handles - 1, old - 1, -1)  # popped from the end: lowest first
        hs = [self._free.pop() for _ in ids]
        for rid, h in zip(ids, hs):
            self.requests[rid] = h
        hs_t = torch.tensor(hs)
        C = self.capacity
        self._tok[:, 1:].view(self.num_layers, -1, C)[:, hs_t] = -1  # fresh: all slots empty, order 0..C-1
        self._order[:, hs_t] = self._arange
        self._bound[:, hs_t] = 0

    def finish(self, request_id: str) -> bool:
        with self._lock:
            h = self.requests.pop(request_id, None)
            if h is not None:
                self._free.append(h)
        return h is not None

    def residency(self, request_id: str, layer: int) -> dict[int, int]:
        h = self.requests.get(request_id)
        if h is None:
            return {}
        C = self.capacity
        row = self._tok[layer, 1 + h * C : 1 + (h + 1) * C].tolist()
        return {t: s for s, t in enumerate(row) if t >= 0}

    def resident(self, layer: int, ids: list[str], tokens: torch.Tensor) -> torch.Tensor:
        """bool ``[rows, n]``: True where ``tokens[r, j]`` sits in a slot of (request r, ``layer``) now; one
        map lookup and one compare, as a step's hit test (changes nothing)."""
        with self._lock:
            out = torch.zeros(tokens.shape, dtype=torch.bool)
            rows = [r for r, rid in enumerate(ids) if rid in self.requests]  # a request with no state: none
            if not rows:
                return out
            h = torch.tensor([self.requests[ids[r]] for r in rows])  # [R']
            t = tokens[rows]  # [R', n]
            T = self._width
            valid = (t >= 0) & (t < T)  # a token past the map's width was never placed
            key = torch.where(valid, h[:, None] * T + t, self._handles * T).view(-1)  # invalid: the padding entry
            held = self._tok[layer].index_select(0, self._map[layer].index_select(0, key)).view_as(t)
            out[rows] = valid & (held == t)
            return out

    # ---- one step --------------------------------------------------------------------------------

    def resolve(self, layer: int, ids: list[str], topk: torch.Tensor, stable: list[int]) -> Resolution:
        with self._lock:
            return self._resolve(layer, ids, topk, stable)

    def _resolve(self, layer: int, ids: list[str], topk: torch.Tensor, stable: list[int]) -> Resolution:
        R, k = topk.shape
        C = self.capacity
        t = topk.long()  # [R, k]
        S = torch.tensor(stable, dtype=torch.int64)  # [R]
        tmax = _validate(t, S)
        if R == 0:
            return _empty(0, k)
        hs = self._handles_of(ids)
        h = torch.tensor(hs)  # [R]
        if tmax >= self._width:
            self._resize(self._handles, max(2 * self._width, tmax + 1))
        T = self._width
        tok, order_l, bound_l, map_l = self._tok[layer], self._order[layer], self._bound[layer], self._map[layer]
        base = (h * C + 1)[:, None]  # [R, 1] tok index of each row's slot 0
        # the rows' order: a view when the handles are consecutive (the usual case), else a copy
        h0 = hs[0]
        block = hs == list(range(h0, h0 + R))
        order = order_l[h0 : h0 + R] if block else order_l.index_select(0, h)  # [R, C] least recent first

        if bool((S < bound_l.index_select(0, h)).any()):  # (1) drop tokens >= S where S shrank
            order = self._drop_shrunk(tok, order, base, S)
        if k == 0:
            self._store(order_l, order, block, h0, h, bound_l, S)
            return _empty(R, 0)

        valid = t >= 0  # [R, k]
        key = torch.where(valid, h[:, None] * T + t, self._handles * T).view(-1)  # [R*k] map index
        at = map_l.index_select(0, key)  # [R*k] tok index of the token's last slot (0: none)
        hit = (tok.index_select(0, at) == t.view(-1)).view(R, k)  # the slot still holds it
        cols = self._cols(R, k)  # [R*k] column of each entry
        self._scratch.scatter_reduce_(0, key, cols, "amin", include_self=False)
        first = self._scratch.index_select(0, key)  # [R*k] column of the token's first occurrence
        is_first = (first == cols).view(R, k)
        hit_first = hit & is_first
        miss_first = is_first & valid & ~hit
        n_hits = hit_first.sum(1, keepdim=True)  # [R, 1]
        n_miss = miss_first.sum(1, keepdim=True)

        order = _reorder(order, hit_first, at.view(R, k) - base, n_hits, n_miss)  # (2)+(3)
        miss_rows, miss_tokens, miss_slots, cell = _place_misses(tok, map_l, t, h, T, order, base, miss_first, n_miss)
        slots = map_l.index_select(0, key).view(R, k) - base  # every token is placed now (duplicates too)
        slots.masked_fill_(~valid, -1)

        spec = miss_tokens >= S.index_select(0, miss_rows)  # (4) speculative misses are not kept
        if bool(spec.any()):
            order = _drop_speculative(tok, order, cell, miss_rows, miss_slots, spec)

        self._store(order_l, order, block, h0, h, bound_l, S)
        return Resolution(
            slots=slots.int(),
            miss_rows=miss_rows.int(),
            miss_tokens=miss_tokens,
            miss_slots=miss_slots.int(),
            num_hits=int(n_hits.sum()),
            num_misses=miss_rows.numel(),
        )

    def _handles_of(self, ids: list[str]) -> list[int]:
        """Each row's handle, those of requests joining allocated (per row: the id -> handle dict)."""
        new = [rid for rid in ids if rid not in self.requests]
        if new:
            self._alloc(new)
        return [self.requests[rid] for rid in ids]

    def _drop_shrunk(self, tok: torch.Tensor, order: torch.Tensor, base: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
        """(1) Empty each row's slots holding tokens >= its stable length ``S`` and move them to the
        front of ``order`` [R, C]; the new order."""
        R, C = order.shape
        cells = base + self._arange  # [R, C]
        drop = tok.index_select(0, cells.view(-1)).view(R, C) >= S[:, None]
        if bool(drop.any()):
            tok.index_fill_(0, cells[drop], -1)
            order = _to_front_desc(order, drop)
        return order

    def _cols(self, R: int, k: int) -> torch.Tensor:
        if self._cols_cache.shape != (R * k,) or self._cols_k != k:
            self._cols_cache, self._cols_k = torch.arange(k).repeat(R), k
        return self._cols_cache

    @staticmethod
    def _store(order_l, order, block, h0, h, bound_l, S) -> None:
        if block:
            order_l[h0 : h0 + len(h)] = order
        else:
            order_l.index_copy_(0, h, order)
        bound_l.index_copy_(0, h, S)


def _reorder(
    order: torch.Tensor, hit_first: torch.Tensor, slot: torch.Tensor, n_hits: torch.Tensor, n_miss: torch.Tensor
) -> torch.Tensor:
    """(2)+(3) as one permutation of ``order`` [R, C]: after (2) the order is [non-hits, in order][hits
    by first occurrence]; (3) gives the M front slots to the misses in order and moves them to the
    back, i.e. rotates left by M. New position of each slot, then one scatter. ``hit_first`` [R, k]
    marks first occurrences that hit, ``slot`` [R, k] their slots, ``n_hits`` / ``n_miss`` [R, 1]."""
    R, C = order.shape
    final = hit_first.cumsum(1) + (C - 1 - n_hits - n_miss)  # [R, k] final position of each hit
    pos_by_slot = torch.full((R, C + 1), -1, dtype=torch.int64)
    pos_by_slot.scatter_(1, torch.where(hit_first, slot, C), final)  # column C: a sink
    pos = pos_by_slot.gather(1, order)  # [R, C] by position: a hit's final position, else -1
    rest = pos < 0
    before = rest.cumsum(1) - (1 + n_miss)  # a non-hit's position, rotated left by M
    before += (before < 0) * C  # (cheaper than remainder)
    pos = torch.where(rest, before, pos)
    return torch.empty_like(order).scatter_(1, pos, order)


def _place_misses(
    tok: torch.Tensor,
    map_l: torch.Tensor,
    t: torch.Tensor,
    h: torch.Tensor,
    T: int,
    order: torch.Tensor,
    base: torch.Tensor,
    miss_first: torch.Tensor,
    n_miss: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(3) The misses (``miss_first`` [R, k]) into the slots ``order`` (after the permutation) gave
    them, written to ``tok`` and the map: (rows, tokens, slots, tok indices) [M] each, row-major (by
    row, then first occurrence)."""
    k, C = miss_first.shape[1], order.shape[1]
    idx = miss_first.view(-1).nonzero().squeeze(1)  # [M] row-major: by row, then first occurrence
    miss_rows = idx // k
    miss_tokens = t.view(-1).index_select(0, idx)
    miss_rank = miss_first.cumsum(1).view(-1).index_select(0, idx) - 1  # [M] rank in its row
    victim = (C - n_miss.view(-1)).index_select(0, miss_rows) + miss_rank  # [M] position after (3)
    miss_slots = order.view(-1).index_select(0, miss_rows * C + victim)
    cell = base.view(-1).index_select(0, miss_rows) + miss_slots  # [M] tok index
    tok.index_put_((cell,), miss_tokens)
    map_l.index_put_((h.index_select(0, miss_rows) * T + miss_tokens,), cell)
    return miss_rows, miss_tokens, miss_slots, cell


def _drop_speculative(
    tok: torch.Tensor,
    order: torch.Tensor,
    cell: torch.Tensor,
    miss_rows: torch.Tensor,
    miss_slots: torch.Tensor,
    spec: torch.Tensor,
) -> torch.Tensor:
    """(4) Empty the slots of the speculative misses (``spec`` [M]) and move them to the front of
    ``order`` [R, C]; the new order."""
    R, C = order.shape
    tok.index_fill_(0, cell[spec], -1)
    drop = torch.zeros(R * C, dtype=torch.bool).index_fill_(0, (miss_rows * C + miss_slots)[spec], True)
    return _to_front_desc(order, drop.view(R, C))


def _validate(t: torch.Tensor, S: torch.Tensor) -> int:
    """The reference's checks and messages (first failure in row order; per row the stable
    length first, then the tokens in order), vectorized; nothing is changed before them.
    Returns the largest token (-1 if none)."""
    lo, hi = torch.aminmax(t) if t.numel() else (torch.tensor(0), torch.tensor(-1))
    if lo >= -1 and hi <= MAX_TOKEN and (S.numel() == 0 or S.min() >= 0):
        return int(hi)
    bad_s = S < 0  # [R]
    bad_t = (t < -1) | (t > MAX_TOKEN)  # [R, k]
    bad_row = bad_s | bad_t.any(1)
    if not bool(bad_row.any()):
        return int(hi)
    r = int(bad_row.nonzero()[0, 0])
    if bool(bad_s[r]):
        raise ValueError(f"stable_lens[{r}] = {int(S[r])} must be >= 0")
    j = int(bad_t[r].nonzero()[0, 0])
    v = int(t[r, j])
    if v < -1:
        raise ValueError(f"topk[{r}, {j}] = {v} is not a token index (>= 0) or -1 padding")
    raise ValueError(f"topk[{r}, {j}] = {v} exceeds the largest supported token index {MAX_TOKEN}")


def _empty(rows: int, k: int) -> Resolution:
    return Resolution(
        slots=torch.full((rows, k), -1, dtype=torch.int32),
        miss_rows=torch.empty(0, dtype=torch.int32),
        miss_tokens=torch.empty(0, dtype=torch.int64),
        miss_slots=torch.empty(0, dtype=torch.int32),
        num_hits=0,
        num_misses=0,
    )
