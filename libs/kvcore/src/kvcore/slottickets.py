"""A slot's occupant: ``SlotTicket``, the handle its items settle through, and its mutable state.

An occupant has three kinds of items: the compute that produced the layer, its host-pool save,
and one READ_DONE or READ_FAILED per registered reader. Each settles exactly once, from whichever
thread finishes it, through the occupant's ``SlotTicket``; the slot's gate (``kvcore.gates``, whose
docstring maps who calls what) frees the slot once all have settled.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

PENDING, DONE, FAILED = "pending", "done", "failed"
_MAX_LISTED_READERS = 8


class Settles(Protocol):
    """What a ticket needs of its gate (``kvcore.gates.SlotGate``): the lock guarding the occupants,
    and the one place an item settles."""

    _cond: threading.Condition

    def _settle(
        self,
        ticket: SlotTicket,
        item: str,
        state: str,
        *,
        cause: BaseException | None = ...,
        reader: Hashable = ...,
        reason: str = ...,
    ) -> None: ...


class Occupancy:
    """Mutable state of one occupant; guarded by its gate's lock."""

    __slots__ = (
        "layer",
        "generation",
        "readers",
        "owner",
        "compute",
        "save",
        "reads_done",
        "reads_failed",
        "failures",
        "failure_reported",
    )

    def __init__(self, layer: int, generation: int, readers: frozenset, owner: Hashable):
        self.layer, self.generation, self.readers, self.owner = layer, generation, readers, owner
        self.compute = self.save = PENDING
        self.reads_done: set = set()
        self.reads_failed: dict = {}  # reader -> reason
        self.failures: list[tuple[str, str, BaseException | None]] = []  # (item, description, exception)
        self.failure_reported = False

    def reads_pending(self) -> list:
        return sorted((r for r in self.readers if r not in self.reads_done and r not in self.reads_failed), key=repr)

    @property
    def settled(self) -> bool:
        return (
            self.compute != PENDING
            and self.save != PENDING
            and len(self.reads_done) + len(self.reads_failed) == len(self.readers)
        )

    @property
    def free(self) -> bool:
        return self.settled and (not self.failures or self.failure_reported)

    def pending(self) -> str:
        parts = []
        if self.save == PENDING:
            parts.append("save pending")
        waiting = self.reads_pending()
        if waiting:
            shown = ", ".join(repr(r) for r in waiting[:_MAX_LISTED_READERS])
            more = f" and {len(waiting) - _MAX_LISTED_READERS} more" if len(waiting) > _MAX_LISTED_READERS else ""
            parts.append(f"READ_DONE pending from {len(waiting)} of {len(self.readers)} readers: {shown}{more}")
        if self.compute == PENDING:
            parts.append("compute pending")
        return "; ".join(parts)


@dataclass(frozen=True, eq=False)
class SlotTicket:
    """The occupant of ``slot``: ``layer`` owns the buffer until a later acquire supersedes it.

    Every item settles exactly once, from whichever thread finishes it; the slot frees itself when
    all have settled. A call on a superseded ticket (stale ``generation``), a second settle of the
    same item or an unregistered reader raises ValueError and changes nothing.
    """

    slot: int
    layer: int
    generation: int
    readers: frozenset
    _gate: Settles = field(repr=False)
    _occ: Occupancy = field(repr=False)

    def computed(self) -> None:
        self._gate._settle(self, "compute", DONE)

    def compute_failed(self, cause: BaseException) -> None:
        self._gate._settle(self, "compute", FAILED, cause=cause)

    def saved(self) -> None:
        self._gate._settle(self, "save", DONE)

    def save_failed(self, cause: BaseException) -> None:
        self._gate._settle(self, "save", FAILED, cause=cause)

    def read_done(self, reader: Hashable) -> None:
        self._gate._settle(self, "read", DONE, reader=reader)

    def read_failed(self, reader: Hashable, reason: str) -> None:
        self._gate._settle(self, "read", FAILED, reader=reader, reason=reason)

    def fail_pending_reads(self, reason: str) -> int:
        """READ_FAILED for every reader that has not answered yet (e.g. its announce could not be
        sent); returns how many. Readers that answered keep their answer."""
        with self._gate._cond:
            occ = self._occ
            pending = [r for r in occ.readers if r not in occ.reads_done and r not in occ.reads_failed]
        for reader in pending:
            try:
                self.read_failed(reader, reason)
            except ValueError:  # answered meanwhile
                pass
        return len(pending)

    @property
    def is_settled(self) -> bool:
        with self._gate._cond:
            return self._occ.settled

    def pending(self) -> str:
        """What is still missing, e.g. ``"save pending; compute pending"``; ``""`` once settled."""
        with self._gate._cond:
            return self._occ.pending()
