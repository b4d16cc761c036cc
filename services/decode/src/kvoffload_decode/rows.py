"""Installing pulled prompt rows, one implementation for both kinds of decode rank: rank 0's
``DecodeLoop`` and a TP follower's ``FollowerPulls``.

A pull hands a layer's rows ``[start, start + n)`` of a pending request to ``RowInstaller.write_rows``,
which checks them against the prompt, copies them into the decoder's host pool and indexer cache,
and counts them installed: rows ``[0, rows[layer])`` of each layer, plus the ranges ``ahead`` of a
gap (``installed_prefix``: contributor ranks send their shares of a layer in any order, and a retry
or duplicate may repeat a range). A request's record (``DecodeRequest`` or ``PulledRequest``)
carries ``rows``, ``ahead``, ``num_prompt_tokens``, ``copies`` (installs running) and
``free_after_copies`` (cancelled while they ran: the last one frees it, through ``free``).

Where the copy runs is the one difference between the ranks: on rank 0 outside the loop's locks (a
decode step need not wait for it, nor it for a step: the request's rows and blocks are its own); on
a follower under its lock (``copy_lock``), which ``follow_decode`` also holds while it applies rank
0's ops, so a step and an install take turns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Generic, Protocol, TypeVar

import torch

from kvoffload_engine.decode import SparseDecoder


def installed_prefix(prefix: int, ahead: list[tuple[int, int]], start: int, end: int) -> int:
    """Rows ``[0, prefix)`` and the ranges in ``ahead`` are installed; so is ``[start, end)`` now.
    Returns the new length of the installed prefix; ``ahead`` keeps (sorted, updated in place) the
    ranges still separated from it by a gap. Contributor ranks send their shares of a layer in any
    order, and a retry or duplicate may repeat a range."""
    if end <= start:
        return prefix
    ahead.append((start, end))
    ahead.sort()
    while ahead and ahead[0][0] <= prefix:
        prefix = max(prefix, ahead.pop(0)[1])
    return prefix


class Installing(Protocol):
    """What ``RowInstaller`` reads and counts of a request's record (``DecodeRequest`` on rank 0,
    ``PulledRequest`` on a follower; module doc)."""

    rows: list[int]
    ahead: list[list[tuple[int, int]]]
    copies: int
    free_after_copies: str | None

    @property
    def num_prompt_tokens(self) -> int: ...


R = TypeVar("R", bound=Installing)


class RowInstaller(Generic[R]):
    """Installs the pulled rows of the requests in ``pending`` (guarded by ``lock``) into ``decoder``
    (module doc). ``copy_lock``: held around each copy (a follower's ``lock``; none on rank 0).
    ``free(req, outcome)``: frees a request cancelled while its rows were copied (rank 0 only: a
    follower's requests are never cancelled during a copy)."""

    def __init__(
        self,
        decoder: SparseDecoder,
        lock: threading.Condition,
        pending: dict[str, R],
        *,
        copy_lock: AbstractContextManager | None = None,
        free: Callable[[R, str], None] | None = None,
    ) -> None:
        self.decoder, self.lock, self.pending = decoder, lock, pending
        self.copy_lock = copy_lock if copy_lock is not None else nullcontext()
        self.free = free

    def write_rows(self, request_id: str, layer: int, start: int, kv: torch.Tensor, index_k: torch.Tensor) -> float:
        """Install rows [start, start + n) of a layer; returns the seconds the copy took. KeyError when
        the request is not pending (or was cancelled while its rows were copied), ValueError when
        the rows go past its prompt."""
        end = start + kv.shape[0]
        with self.copy_lock:
            with self.lock:
                req = self.pending.get(request_id)
                if req is None:
                    raise KeyError(request_id)
                if end > req.num_prompt_tokens:
                    raise ValueError(f"rows [{start}, {end}) go past the prompt's {req.num_prompt_tokens} tokens")
                req.copies += 1
            t = time.perf_counter()
            ok = False
            try:
                self.decoder.write_prompt_layer(request_id, layer, kv, index_k, start=start)
                ok = True
            finally:
                elapsed = time.perf_counter() - t
                ok, free = self._copied(req, layer, start, end, ok)
                if free is not None:
                    assert self.free is not None, "only rank 0 cancels a request during a copy, and it passes free"
                    self.free(req, free)
        if not ok:
            raise KeyError(request_id)  # cancelled while its rows were copied
        return elapsed

    def _copied(self, req: R, layer: int, start: int, end: int, ok: bool) -> tuple[bool, str | None]:
        """One copy ended (``ok``: it succeeded): count its rows, unless the request was cancelled
        meanwhile; returns whether they count, and the outcome to free it with when this was its
        last copy of a cancelled request."""
        with self.lock:
            req.copies -= 1
            free = None
            if req.free_after_copies is not None:
                if not req.copies:
                    free = req.free_after_copies  # the last copy frees it (decoder state: engine_lock)
                ok = False
            elif ok:
                req.rows[layer] = installed_prefix(req.rows[layer], req.ahead[layer], start, end)
            self.lock.notify_all()
        return ok, free
