"""The decode loop's state as its parts see it (``LoopState``): what ``DecodeLoop`` holds and its
parts (``Admission``, ``PrefillReports``, ``RankPolling``) read and change.

``DecodeLoop`` sets every attribute in its ``__init__`` and implements ``cancel``; each part
subclasses ``LoopState`` so that what it uses of the loop is declared, with its type, in one place.
The locks and their order are ``DecodeLoop``'s (see its docstring).
"""

from __future__ import annotations

import threading
from typing import Protocol

from kvoffload_decode.queue_wait import StartPace
from kvoffload_decode.request import DecodeRequest
from kvoffload_decode.rows import RowInstaller
from kvoffload_engine.decode import SparseDecoder
from kvoffload_engine.tp_decode import LeadDecoder
from svcruntime.ledger import Ledger


class LoopState(Protocol):
    """What ``DecodeLoop`` holds, as its parts use it (module doc)."""

    decoder: SparseDecoder
    lead: LeadDecoder | None  # TP: the decoder, when it is a LeadDecoder
    eos_token_id: int | None
    peer_timeout_s: float
    max_queued: int
    ledger: Ledger
    engine_lock: threading.RLock  # taken before ``lock``, never after
    lock: threading.Condition
    pending: dict[str, DecodeRequest]  # admitted, not running yet (blocks reserved or waiting)
    waiting: list[DecodeRequest]  # the pending ones still waiting for host blocks, FIFO
    running: list[DecodeRequest]
    rejected: int  # requests refused at admission (429): the queue full, or the estimate past the bound
    rejected_by_estimate: int  # of those, refused because the estimated wait was past ``max_queue_wait_s``
    max_queue_wait_s: float  # the longest a request stays queued before it starts (0: no bound)
    queue_timeouts: int  # queued requests refused once they waited past the bound
    pace: StartPace
    expiry_scanned_at: float  # monotonic time of the last scan for requests past the bound
    installer: RowInstaller[DecodeRequest]
    _stop: bool

    def cancel(self, request_id: str, reason: str, outcome: str = "cancelled") -> bool:
        """Stop a request wherever it is and free everything it holds. False if unknown."""
        ...
