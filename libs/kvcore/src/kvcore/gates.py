"""Slot reuse gates: when a shared physical layer buffer ("slot") may take its next layer (I4).

Prefill writes many logical layers through a few physical device buffers. ``SlotGate`` guards one
slot; ``GateSet`` holds one gate per slot and maps layers to slots. A slot is handed to a new layer
only when every item of its previous occupant is settled: (a) the host-pool save, (b) READ_DONE or
READ_FAILED from every registered reader (any hashable id, e.g. ``(request_id, endpoint)``; the
set is fixed at ``acquire``; an empty set never blocks; a reader owning no blocks must still ack),
(c) the compute that produced it. Ownership is handed over as a ``SlotTicket``: it *is* the
occupant until a later ``acquire`` on the same slot supersedes it. Nobody releases a ticket
explicitly: it frees its slot by having all of its items settled. ``SlotTicket`` and the
occupant's state live in ``kvcore.slottickets``; the hook map below covers both modules.

Failures. ``save_failed``/``compute_failed``/``read_failed`` settle an item as failed. The first
waiter of the same ``owner`` (e.g. the same request; ``None`` by default) that reaches the slot
afterwards raises ``OccupantFailed`` at once (it need not wait for the remaining items); that
report consumes the failures. A waiter of another owner is not failed by them: it waits until
every item is settled and then acquires (one request's failure never fails the next request). The
slot itself becomes free only when all items are settled, so nothing is overwritten while in
flight, and a retry or the next request then acquires it normally. A timed-out wait raises
``GateTimeout`` and frees nothing (something may still be in flight). Waiters on one slot are served
first come, first served.

Hooks by caller
---------------
Engine thread (prefill layer loop):
  ``GateSet.acquire(layer, readers, timeout_s)`` / ``SlotGate.acquire(...)``: blocks until the slot
      is free, at most ``timeout_s`` (or the gate's default). Returns the new occupant's ticket, or
      raises ``OccupantFailed`` (previous occupant failed), ``GateTimeout`` (names what is missing)
      or ``GateAborted``. Not idempotent: every return makes a new occupant. Must not be called
      while holding a lock that a save worker or the transfer servicer needs to settle items.
  ``SlotGate.is_free()``: never blocks, no side effects; True iff ``acquire`` would return a
      ticket at once (False while an unreported failure or an earlier waiter is pending).
  ``SlotTicket.computed()`` / ``SlotTicket.compute_failed(cause)``: never block (one short lock).
      Settle the compute item once; a second call raises ValueError. After a compute fault the
      engine must also settle what it never started: ``save_failed`` for a save it never queued,
      ``read_failed`` for readers it never announced to, or the slot stays held.
Save worker:
  ``SlotTicket.saved()`` / ``SlotTicket.save_failed(cause)``: never block. Settle the save once;
      duplicates raise ValueError. Call only after the data left the buffer (or never will).
Transfer servicer (READ_DONE / READ_FAILED from decode endpoints):
  ``GateSet.ticket(layer)``: never blocks; the current ticket of the slot whose occupant is
      ``layer``; ValueError if ``layer`` is not the occupant (late message of an older occupant).
  ``SlotTicket.read_done(reader)`` / ``SlotTicket.read_failed(reader, reason)``: never block.
      Settle one reader once; a duplicate, unknown reader or stale ticket raises ValueError and
      changes nothing, so hostile or replayed network messages cannot free a slot.
  ``SlotTicket.fail_pending_reads(reason)``: never blocks. READ_FAILED for every reader that has
      not answered (its announce could not be sent); readers that answered keep their answer.
Stats reader, admission and tests (never block beyond one short lock; read only):
  ``SlotGate.snapshot()``, ``SlotGate.occupant``, ``SlotGate.stats()``, ``GateSet.gate(slot)``,
  ``GateSet.stats()``, ``SlotTicket.pending()``, ``SlotTicket.is_settled``. Must not call ticket
  methods: they change state.
Shutdown:
  ``GateSet.abort_all(reason)`` / ``SlotGate.abort(reason)``: never block. Wake every waiter, which
      raises ``GateAborted``; later ``acquire`` calls raise too (a gate stays aborted). Idempotent
      (the first reason is kept). Ticket methods keep working so in-flight work can still settle.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from kvcore.slottickets import DONE, FAILED, PENDING, Occupancy, SlotTicket


class SlotGateError(RuntimeError):
    """A slot could not be acquired. ``slot``, ``layer`` (the waiter) and ``previous_layer``."""

    def __init__(self, message: str, *, slot: int, layer: int, previous_layer: int | None = None):
        super().__init__(message)
        self.slot, self.layer, self.previous_layer = slot, layer, previous_layer


class GateTimeout(SlotGateError):
    """The wait ran out; the slot stays held by its previous occupant."""


class OccupantFailed(SlotGateError):
    """The previous occupant's save, compute or a remote read failed; ``__cause__`` is the exception."""


class GateAborted(SlotGateError):
    """The gate was aborted (shutdown)."""


@dataclass(frozen=True)
class GateSnapshot:
    """What one slot holds right now (``layer`` None: never occupied)."""

    slot: int
    generation: int
    layer: int | None
    readers: frozenset
    compute: str | None
    save: str | None
    reads_done: frozenset
    reads_failed: frozenset  # of (reader, reason)
    failures: tuple[str, ...]
    settled: bool
    free: bool
    pending: str
    waiters: int
    aborted: str | None


class SlotGate:
    """Reuse gate of one physical slot; see the module docstring for who calls what."""

    def __init__(self, slot: int, default_timeout_s: float = 60.0):
        self.slot = slot
        self.default_timeout_s = _check_timeout(default_timeout_s)
        self._cond = threading.Condition()
        self._occ: Occupancy | None = None
        self._ticket: SlotTicket | None = None
        self._generation = 0
        self._queue: deque[object] = deque()
        self._aborted: str | None = None
        self._counts = {"acquires": 0, "waits": 0, "timeouts": 0, "failures": 0, "aborts": 0}
        self._total_wait_s = 0.0

    def is_free(self) -> bool:
        with self._cond:
            return self._free_locked()

    def acquire(
        self, layer: int, readers: Iterable[Hashable] = (), timeout_s: float | None = None, owner: Hashable = None
    ) -> SlotTicket:
        timeout = self.default_timeout_s if timeout_s is None else _check_timeout(timeout_s)
        if isinstance(readers, (str, bytes)):
            raise ValueError(f"readers must be a collection of reader ids, got the single string {readers!r}")
        reader_set = frozenset(readers)
        start = time.monotonic()
        deadline, me, blocked = start + timeout, object(), False
        with self._cond:
            self._queue.append(me)
            try:
                while True:
                    occ = self._occ
                    prev = None if occ is None else occ.layer
                    if self._aborted is not None:
                        self._counts["aborts"] += 1
                        raise GateAborted(
                            f"layer {layer} waiting for slot {self.slot} aborted: {self._aborted}",
                            slot=self.slot,
                            layer=layer,
                            previous_layer=prev,
                        )
                    first = self._queue[0] is me
                    if first and occ is not None and occ.failures and not occ.failure_reported:
                        if occ.owner == owner:
                            raise self._report_failure(layer, occ)
                        if occ.settled:  # another owner's failure: nothing in flight, nothing to report
                            occ.failure_reported = True
                    if first and (occ is None or occ.free):
                        return self._grant(layer, reader_set, owner)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        self._counts["timeouts"] += 1
                        raise GateTimeout(
                            self._timeout_message(layer, me, time.monotonic() - start),
                            slot=self.slot,
                            layer=layer,
                            previous_layer=prev,
                        )
                    blocked = True
                    self._cond.wait(remaining)
            finally:
                self._queue.remove(me)
                if blocked:
                    self._counts["waits"] += 1
                    self._total_wait_s += time.monotonic() - start
                self._cond.notify_all()

    def abort(self, reason: str) -> None:
        with self._cond:
            if self._aborted is None:
                self._aborted = reason
            self._cond.notify_all()

    @property
    def occupant(self) -> SlotTicket | None:
        with self._cond:
            return self._ticket

    def snapshot(self) -> GateSnapshot:
        with self._cond:
            occ = self._occ
            if occ is None:
                return GateSnapshot(
                    self.slot,
                    self._generation,
                    None,
                    frozenset(),
                    None,
                    None,
                    frozenset(),
                    frozenset(),
                    (),
                    True,
                    self._free_locked(),
                    "",
                    len(self._queue),
                    self._aborted,
                )
            return GateSnapshot(
                self.slot,
                occ.generation,
                occ.layer,
                occ.readers,
                occ.compute,
                occ.save,
                frozenset(occ.reads_done),
                frozenset(occ.reads_failed.items()),
                tuple(desc for _, desc, _ in occ.failures),
                occ.settled,
                self._free_locked(),
                occ.pending(),
                len(self._queue),
                self._aborted,
            )

    def stats(self) -> dict[str, float]:
        with self._cond:
            held = int(self._occ is not None and not self._occ.settled)
            return {**self._counts, "held": held, "total_wait_s": self._total_wait_s}

    # -- internals (called with or taking self._cond) --

    def _free_locked(self) -> bool:
        return self._aborted is None and not self._queue and (self._occ is None or self._occ.free)

    def _grant(self, layer: int, readers: frozenset, owner: Hashable) -> SlotTicket:
        self._generation += 1
        self._occ = Occupancy(layer, self._generation, readers, owner)
        self._ticket = SlotTicket(self.slot, layer, self._generation, readers, self, self._occ)
        self._counts["acquires"] += 1
        return self._ticket

    def _report_failure(self, layer: int, occ: Occupancy) -> OccupantFailed:
        occ.failure_reported = True
        self._counts["failures"] += 1
        still = occ.pending()
        msg = (
            f"layer {layer} cannot use slot {self.slot}: previous occupant layer {occ.layer} "
            f"(generation {occ.generation}) failed: "
            + "; ".join(d for _, d, _ in occ.failures)
            + (f" (slot stays held until settled: {still})" if still else "")
        )
        err = OccupantFailed(msg, slot=self.slot, layer=layer, previous_layer=occ.layer)
        causes = {item: exc for item, _, exc in occ.failures if exc is not None}
        err.__cause__ = causes.get("save") or causes.get("compute")
        return err

    def _timeout_message(self, layer: int, me: object, waited_s: float) -> str:
        occ = self._occ
        head = f"layer {layer} waited {waited_s:.2f} s for slot {self.slot}"
        if occ is None:
            head += " (no previous occupant)"
            parts = []
        else:
            head += f" (previous occupant layer {occ.layer})"
            parts = [occ.pending()] if occ.pending() else []
            parts += [f"already {d}" for _, d, _ in occ.failures]
        ahead = list(self._queue).index(me)
        if ahead:
            parts.append(f"{ahead} earlier waiter(s) queued for this slot")
        return head + ": " + ("; ".join(parts) or "nothing pending")

    def _settle(
        self,
        ticket: SlotTicket,
        item: str,
        state: str,
        *,
        cause: BaseException | None = None,
        reader: Hashable = None,
        reason: str = "",
    ) -> None:
        if state == FAILED and item != "read" and not isinstance(cause, BaseException):
            raise ValueError(f"{item}_failed needs an exception as cause, got {cause!r}")
        if state == FAILED and item == "read" and not isinstance(reason, str):
            raise ValueError(f"read_failed needs a str reason, got {reason!r}")
        with self._cond:
            occ = ticket._occ
            what = f"slot {self.slot} layer {ticket.layer} generation {ticket.generation}"
            if self._occ is not occ:
                raise ValueError(f"stale ticket: {what} was superseded by generation {self._generation}")
            if item == "read":
                if reader not in occ.readers:
                    raise ValueError(f"{what}: reader {reader!r} is not registered")
                if reader in occ.reads_done or reader in occ.reads_failed:
                    raise ValueError(f"{what}: reader {reader!r} already acked")
                if state == DONE:
                    occ.reads_done.add(reader)
                else:
                    occ.reads_failed[reader] = reason
                    occ.failures.append(("read", f"READ_FAILED from {reader!r}: {reason}", None))
            else:
                if getattr(occ, item) != PENDING:
                    raise ValueError(f"{what}: {item} already settled ({getattr(occ, item)})")
                setattr(occ, item, state)
                if state == FAILED:
                    occ.failures.append((item, f"{item} failed: {cause!r}", cause))
            self._cond.notify_all()


class GateSet:
    """One ``SlotGate`` per physical slot of a buffer plan; ``layer_to_slot`` maps layer -> slot."""

    def __init__(self, layer_to_slot: Mapping[int, int], default_timeout_s: float = 60.0):
        for layer, slot in layer_to_slot.items():
            if not isinstance(layer, int) or not isinstance(slot, int) or layer < 0 or slot < 0:
                raise ValueError(f"layer_to_slot entry {layer!r} -> {slot!r}: layer and slot must be ints >= 0")
        self._layer_to_slot = dict(layer_to_slot)
        self._gates = {s: SlotGate(s, default_timeout_s) for s in sorted(set(self._layer_to_slot.values()))}

    def acquire(
        self, layer: int, readers: Iterable[Hashable] = (), timeout_s: float | None = None, owner: Hashable = None
    ) -> SlotTicket:
        return self._gates[self._slot_of(layer)].acquire(layer, readers, timeout_s, owner)

    def gate(self, slot: int) -> SlotGate:
        if slot not in self._gates:
            raise ValueError(f"slot {slot} is not in the plan (slots {sorted(self._gates)})")
        return self._gates[slot]

    def ticket(self, layer: int) -> SlotTicket:
        slot = self._slot_of(layer)
        ticket = self._gates[slot].occupant
        if ticket is None or ticket.layer != layer:
            held = None if ticket is None else ticket.layer
            raise ValueError(f"layer {layer} is not the current occupant of slot {slot} (occupant: layer {held})")
        return ticket

    def stats(self) -> dict[str, float]:
        per_gate = [g.stats() for g in self._gates.values()]
        out: dict[str, float] = {"slots": len(self._gates), "held_slots": sum(s["held"] for s in per_gate)}
        for key in ("acquires", "waits", "timeouts", "failures", "aborts", "total_wait_s"):
            out[key] = sum(s[key] for s in per_gate)
        return out

    def abort_all(self, reason: str) -> None:
        for g in self._gates.values():
            g.abort(reason)

    def _slot_of(self, layer: int) -> int:
        if layer not in self._layer_to_slot:
            raise ValueError(f"layer {layer} has no slot in the plan (layers {sorted(self._layer_to_slot)})")
        return self._layer_to_slot[layer]


def _check_timeout(timeout_s: float) -> float:
    if (
        not isinstance(timeout_s, (int, float))
        or isinstance(timeout_s, bool)
        or not math.isfinite(timeout_s)
        or timeout_s < 0
    ):
        raise ValueError(f"timeout_s must be a finite number of seconds >= 0, got {timeout_s!r}")
    return float(timeout_s)
