"""Hot top-k cache: which past tokens of a request's layer sit in which device hot-buffer slot.

On sparse decode the full KV lives in the host pool; per request and layer the device keeps a hot
buffer of ``capacity`` token slots. Each step the indexer selects top-k past tokens; ``resolve``
maps every selected token to a slot: hits reuse their slot, misses take the slots the policy
gives up (of tokens not selected now), and only the misses are gathered
from the host pool
(``kvcore.hotcache.gather.gather_rows`` takes ``miss_rows``/``miss_tokens``/``miss_slots`` unchanged).

Residency is keyed by (request id, layer), never by batch row: requests join, leave and reorder
between steps without touching anyone else's residency. ``finish(request_id)`` frees all of it.

Policies (``policy``):

- ``"lru"``: exact least-recently-used over the slots not selected in this step.
- ``"slru"``: segmented LRU. A token selected in only one step so far (it entered as a miss and
  has not been hit since) sits in a probation list; a hit promotes it to a protected list. Misses
  evict the least-recent probation slot not selected now, and a protected slot only when every
  probation slot is selected now. It bets that a token the indexer kept for more than one step
  (a heavy hitter, a token that flickers at the top-k boundary) returns sooner than one it chose
  once; ``kvoffload bench hotcache`` measures the policies against Belady's optimum on traces.
- ``"clock"`` (default): one-pass CLOCK, one reference bit per slot and no recency order: a hit sets its
  slot's bit; a miss sweeps a hand over the slots, clearing set bits, to the first slot with a
  clear bit not selected in this step. A token loaded by a miss starts with its bit *clear*: it
  survives the hand's next pass only if it is hit before it (like ``"slru"``'s probation). Measured
  (``kvoffload bench hotcache``, hit rate / Belady's at C = 2k): clear 0.9365 on the recorded
  SmolLM2 attention trace against 0.9251 with the bit set, the synthetic presets equal within
  0.0003. It is the default: on what the hot cache is really asked (SmolLM2's own indexer during
  sparse decode, the ``smollm2-indexer`` trace) it keeps 0.990 of Belady's hits at C = 2k (lru
  0.989, slru 0.985) at the lowest native cost of the three.

Exact semantics of ``"lru"`` and ``"slru"`` (the native C++/OpenMP path and the Python reference,
``kvcore.hotcache.reference``, produce identical outputs; ``"clock"`` below):

- State per (request, layer): ``capacity`` slots, each empty or holding one token; two LRU lists
  that hold every slot between them, *probation* and *protected* (``"lru"`` only ever uses
  probation); a token -> slot lookup. New state: all slots empty, probation from least recent
  ``0, 1, ..., capacity-1``, protected empty.
- One step with stable prefix length ``S`` and top-k row ``t[0..k)`` (``-1`` = padding):

  1. Every slot whose token is ``>= S`` becomes empty and moves to the least-recent end of
     probation (slots in ascending index, each moved in turn).
  2. Pass over ``t`` in order: a resident token (hit) moves its slot to the most-recent end of
     the hit list (``"lru"``: probation; ``"slru"``: protected), once per step, on its first
     occurrence.
  3. Pass over ``t`` in order: a token not resolved yet in this step (miss) takes the victim slot
     (evicting its token, if any) and moves it to the most-recent end of probation; duplicates of
     a token already resolved in this step reuse its slot. The victim is the least-recent slot of
     probation; under ``"slru"``, when probation is empty or that slot was selected in this step,
     the least-recent slot of protected. Slots selected in this step sit at the most-recent ends
     (hits moved first, misses appended), and unique tokens <= k <= capacity, so the victim is
     never a slot selected in the same step.
  4. Misses with token ``>= S`` (speculative suffix, may be rewritten) do not stay resident: after
     the step their slots become empty and move to the least-recent end of probation (ascending
     slot index). They are still returned in ``slots`` and the misses of this step.

- Outputs: ``slots[r, j]`` the slot of ``t[j]`` (-1 for padding); misses ordered by row, then by
  first occurrence in the row, each unique miss exactly once; ``num_hits`` counts unique hit tokens
  and ``num_misses`` unique missed tokens (duplicate positions count in neither).
- Shortcut taken by both paths (same outputs): after a step every resident token is ``< S``, so
  step 1 is skipped unless the stable length shrank.

Exact semantics of ``"clock"`` (same outputs, validation and shortcut as above; only the state and
the victim differ):

- State per (request, layer): ``capacity`` slots, each empty or holding one token, each with a
  reference bit; a hand (a slot index); a token -> slot lookup. New state: all slots empty, every
  bit clear, the hand at slot 0. An empty slot's bit is always clear.
- One step with stable prefix length ``S`` and top-k row ``t[0..k)``:

  1. Every slot whose token is ``>= S`` becomes empty (its bit cleared). The hand does not move.
  2. Pass over ``t``: a resident token (hit) sets its slot's bit (duplicates change nothing more);
     the slot is *selected* in this step.
  3. Pass over ``t`` in order: a token not resolved yet in this step (miss) takes the victim slot
     (evicting its token, if any), which becomes selected, its bit clear; duplicates of a token
     already resolved in this step reuse its slot. The victim: starting at the hand, look at slots
     ``hand, hand + 1, ...`` (mod ``capacity``), the hand moving one past each slot looked at: a
     selected slot is passed over unchanged (its bit too); an unselected slot with its bit set has
     it cleared and is passed over; the first unselected slot with its bit clear is the victim (the
     hand stops one past it). Unique tokens <= k <= capacity, so one exists: the sweep ends within
     two turns of the hand.
  4. Misses with token ``>= S`` do not stay resident: after the step their slots become empty
     (bits cleared). They are still returned in ``slots`` and the misses of this step. The hand
     does not move back: an emptied slot is taken when the hand next reaches it.

Validation (ValueError naming the argument, the position and the value; no state changes):
``layer`` in range; request ids unique; ``topk`` a contiguous CPU ``[rows, k]`` int32/int64 tensor
with ``k <= capacity``; then per row in order: ``stable_lens[r] >= 0``, every ``topk[r, j] >= -1``
and ``<= MAX_TOKEN`` (the native token -> slot map is a dense array per (request, layer) indexed
by int32 tokens: 2 bytes per token up to the largest token seen when ``capacity <= 32766``, else
4; small next to the KV it indexes).

Threading: the native path releases the GIL and spreads rows over OpenMP threads
(``max_threads()``; the same threads torch's ops use).
Concurrent calls must touch disjoint (request, layer) pairs (e.g. one thread per layer); the
request-id map is guarded by a lock. The reference path runs one call at a time.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Sequence

import torch

from kvcore.config.names import DEFAULT_HOT_CACHE_POLICY
from kvcore.config.names import HOT_CACHE_POLICIES as POLICIES  # index = the native policy code
from kvcore.hotcache.reference import ReferencePath
from kvcore.hotcache.resolution import Resolution


class HotCache:
    """Per-(request, layer) hot-buffer residency. ``native`` switches C++ (threads) vs reference;
    ``policy`` is one of ``POLICIES`` (module docstring)."""

    def __init__(
        self, capacity: int, num_layers: int, *, native: bool = True, policy: str = DEFAULT_HOT_CACHE_POLICY
    ) -> None:
        capacity, num_layers = operator.index(capacity), operator.index(num_layers)
        if policy not in POLICIES:
            raise ValueError(f"policy = {policy!r} must be one of {', '.join(POLICIES)}")
        if not 1 <= capacity <= 2**30:
            raise ValueError(f"capacity = {capacity} must be in [1, 2**30]")
        if num_layers < 1:
            raise ValueError(f"num_layers = {num_layers} must be >= 1")
        self.capacity = capacity
        self.num_layers = num_layers
        self.native = native
        self.policy = policy
        self._lock = threading.Lock()  # guards the request-id map and the counters, not the work
        self._impl: _Native | ReferencePath
        if native:
            self._impl = _Native(capacity, num_layers, self._lock, POLICIES.index(policy))
        else:
            self._impl = ReferencePath(capacity, num_layers, self._lock, policy)
        self._steps = self._hits = self._misses = self._entries = 0

    def resolve(
        self,
        layer: int,
        request_ids: Sequence[str],
        topk: torch.Tensor,
        stable_lens: Sequence[int] | torch.Tensor,
    ) -> Resolution:
        """Maps the top-k tokens of each row (request) to hot-buffer slots; see module docstring."""
        res = None
        if isinstance(self._impl, _Native):  # it checks every input before it changes any state
            with contextlib.suppress(ValueError, TypeError):  # ... and the checks below name what failed
                res = self._impl.resolve(layer, request_ids, topk, stable_lens)
        if res is None:
            res = self._impl.resolve(*self._checked(layer, request_ids, topk, stable_lens))
        rows, k = topk.shape
        with self._lock:
            self._steps += 1
            self._hits += res.num_hits
            self._misses += res.num_misses
            self._entries += rows * k
        return res

    def _checked(
        self, layer: int, request_ids: Sequence[str], topk: torch.Tensor, stable_lens: Sequence[int] | torch.Tensor
    ) -> tuple[int, list[str], torch.Tensor, list[int]]:
        """``resolve``'s arguments checked as the module docstring says (ValueError naming the argument,
        the position and the value) and normalized: both paths then give the same message."""
        layer = operator.index(layer)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer = {layer} is out of range [0, {self.num_layers})")
        # topk: [rows, k] int32 | int64
        if not isinstance(topk, torch.Tensor) or topk.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk must be an int32 or int64 tensor, got {_describe(topk)}")
        if topk.device.type != "cpu" or topk.dim() != 2 or not topk.is_contiguous():
            raise ValueError(
                f"topk must be a contiguous CPU [rows, k] tensor, got shape {tuple(topk.shape)} "
                f"on {topk.device} (contiguous={topk.is_contiguous()})"
            )
        rows, k = topk.shape
        ids = list(request_ids)
        if len(ids) != rows:
            raise ValueError(f"request_ids has {len(ids)} entries but topk has {rows} rows")
        if len(set(ids)) != rows:
            dup = next(r for r, rid in enumerate(ids) if ids.index(rid) != r)
            raise ValueError(f"request_ids[{dup}] = {ids[dup]!r} appears twice in one call")
        if k > self.capacity:
            raise ValueError(
                f"topk has {k} columns but capacity is {self.capacity} (capacity >= topk guarantees enough slots)"
            )
        return layer, ids, topk, _stable_list(stable_lens, rows)

    def resident(self, layer: int, request_ids: Sequence[str], tokens: torch.Tensor) -> torch.Tensor:
        """Read-only: bool ``[rows, n]``, True where ``tokens[r, j]`` is resident in (request r,
        ``layer``) now. Changes no state (no recency, no counters; a request with no state has
        nothing resident), so it may run while another thread resolves a different layer; padding
        (-1) and tokens never seen are not resident. ``tokens``: contiguous CPU int64 [rows, n]."""
        layer = operator.index(layer)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer = {layer} is out of range [0, {self.num_layers})")
        if (
            not isinstance(tokens, torch.Tensor)
            or tokens.dtype != torch.int64
            or tokens.device.type != "cpu"
            or tokens.dim() != 2
            or not tokens.is_contiguous()
        ):
            raise ValueError(
                f"tokens must be a contiguous CPU int64 [rows, n] tensor, got {_describe(tokens)}"
                + (f" of shape {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor) else "")
            )
        ids = list(request_ids)
        if len(ids) != tokens.shape[0]:
            raise ValueError(f"request_ids has {len(ids)} entries but tokens has {tokens.shape[0]} rows")
        return self._impl.resident(layer, ids, tokens)

    def finish(self, request_id: str) -> bool:
        """Frees every layer's state of ``request_id``; idempotent (False when it had none)."""
        return self._impl.finish(request_id)

    def residency(self, request_id: str, layer: int) -> dict[int, int]:
        """token -> slot of one (request, layer); empty when it has no state. For tests."""
        layer = operator.index(layer)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer = {layer} is out of range [0, {self.num_layers})")
        return self._impl.residency(request_id, layer)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._impl.requests

    def stats(self) -> dict[str, float | int | bool | str]:
        """Cumulative counters since construction (identical on both paths for the same calls)."""
        total = self._hits + self._misses
        return {
            "native": self.native,
            "policy": self.policy,
            "capacity": self.capacity,
            "num_layers": self.num_layers,
            "requests": len(self._impl.requests),
            "steps": self._steps,
            "entries": self._entries,
            "hits": self._hits,
            "misses": self._misses,
            "hit_rate": self._hits / total if total else 0.0,
        }


def max_threads() -> int:
    """OpenMP threads the native path uses."""
    from kvcore import _native_hotcache

    return _native_hotcache.max_threads()


def _describe(x: object) -> str:
    return f"{x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__


def _stable_list(stable_lens: Sequence[int] | torch.Tensor, rows: int) -> list[int]:
    if isinstance(stable_lens, torch.Tensor):
        if stable_lens.dtype.is_floating_point or stable_lens.dtype.is_complex or stable_lens.dtype == torch.bool:
            raise ValueError(f"stable_lens must be an integer tensor, got {stable_lens.dtype}")
        stable = stable_lens.reshape(-1).tolist()  # [rows]
    else:
        stable = [operator.index(s) for s in stable_lens]
    if len(stable) != rows:
        raise ValueError(f"stable_lens has {len(stable)} entries but topk has {rows} rows")
    return stable


class _Native:
    """C++/OpenMP path: state lives in kvcore._native_hotcache, addressed by integer handles."""

    def __init__(self, capacity: int, num_layers: int, lock: threading.Lock, policy: int) -> None:
        from kvcore import _native_hotcache

        self._cache = _native_hotcache.Cache(capacity, num_layers, policy)
        self._lock = lock
        self.requests: dict[str, int] = {}  # request id -> native handle

    def resolve(
        self, layer: int, ids: Sequence[str], topk: torch.Tensor, stable: Sequence[int] | torch.Tensor
    ) -> Resolution:
        """Unchecked arguments are fine: the native side checks every one before it changes any state,
        and a refused call leaves no handle behind. Lean on purpose: at 8 rows this Python is a
        visible part of a call's cost."""
        requests = self.requests
        if not isinstance(stable, list):
            stable = stable.tolist() if isinstance(stable, torch.Tensor) else list(stable)
        with self._lock:
            try:
                handles = [requests[rid] for rid in ids]
                new: list[str] = []
            except KeyError:  # requests joining: allocate their handles (once each: ids may repeat)
                new = list(dict.fromkeys(rid for rid in ids if rid not in requests))
                for rid in new:
                    requests[rid] = self._cache.alloc()
                handles = [requests[rid] for rid in ids]
        try:  # one trip: the native side creates the outputs (its tensor calls are the bulk of a call's cost)
            slots, miss_rows, miss_tokens, miss_slots, hits, misses = self._cache.resolve(layer, handles, topk, stable)
        except (ValueError, IndexError, TypeError) as e:  # TypeError: an argument of the wrong type
            with self._lock:
                for rid in new:  # an invalid call leaves no state behind
                    self._cache.free(requests.pop(rid))
            raise (e if isinstance(e, TypeError) else ValueError(str(e))) from None
        return Resolution(slots, miss_rows, miss_tokens, miss_slots, hits, misses)

    def resident(self, layer: int, ids: list[str], tokens: torch.Tensor) -> torch.Tensor:
        with self._lock:
            handles = [self.requests.get(rid, -1) for rid in ids]
        out = torch.empty(tokens.shape, dtype=torch.bool)
        self._cache.resident(layer, handles, tokens.data_ptr(), tokens.shape[1], out.data_ptr())
        return out

    def finish(self, request_id: str) -> bool:
        with self._lock:
            handle = self.requests.pop(request_id, None)
            if handle is not None:
                self._cache.free(handle)
        return handle is not None

    def residency(self, request_id: str, layer: int) -> dict[int, int]:
        handle = self.requests.get(request_id)
        return {} if handle is None else dict(self._cache.residency(handle, layer))
