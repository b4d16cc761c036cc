"""The per-request ledger: which stage each request reached, since when, and how it ended.

A service opens an entry when a request arrives, moves it from stage to stage, and finishes it
with an outcome ("ok", "error", "cancelled", "timeout", ...) and the error, if any. A stage may
carry a *silence limit*: the longest the request may go without news (``touch``) from the peer it
waits for. The watchdog thread fails every request whose limit passed by calling ``on_timeout``
with a reason that names the peer, the stage and the silence — a missing report becomes a timeout
error instead of a stranded request. ``counters()`` and ``snapshot()`` are what Stats exposes.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Entry:
    request_id: str
    stage: str
    peer: str = ""
    silence_limit_s: float | None = None  # None: this stage has no watchdog
    opened_s: float = field(default_factory=time.monotonic)
    stage_since_s: float = field(default_factory=time.monotonic)
    heard_s: float = field(default_factory=time.monotonic)
    history: list[tuple[str, float]] = field(default_factory=list)  # (stage, seconds since opened)
    outcome: str = ""
    error: str = ""

    def to_dict(self, now: float) -> dict:
        return {
            "request_id": self.request_id,
            "stage": self.stage,
            "peer": self.peer,
            "age_s": round(now - self.opened_s, 3),
            "silent_s": round(now - self.heard_s, 3),
            "history": [[s, round(t, 3)] for s, t in self.history],
            "outcome": self.outcome,
            "error": self.error,
        }


class Ledger:
    """Thread-safe; ``on_timeout(entry, reason)`` runs on the watchdog thread, outside the lock."""

    def __init__(
        self,
        on_timeout: Callable[[Entry, str], None] | None = None,
        *,
        keep_finished: int = 256,
        interval_s: float = 0.25,
    ) -> None:
        self._lock = threading.Lock()
        self._open: OrderedDict[str, Entry] = OrderedDict()
        self._finished: deque[Entry] = deque(maxlen=keep_finished)
        self._outcomes: dict[str, int] = {}
        self._on_timeout = on_timeout
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- recording -------------------------------------------------------------------------

    def open(self, request_id: str, stage: str, *, peer: str = "", silence_limit_s: float | None = None) -> None:
        with self._lock:
            if request_id in self._open:
                raise ValueError(f"request id {request_id!r} is already in the ledger")
            e = Entry(request_id, stage, peer, silence_limit_s)
            e.history.append((stage, 0.0))
            self._open[request_id] = e

    def advance(
        self, request_id: str, stage: str, *, peer: str | None = None, silence_limit_s: float | None = None
    ) -> None:
        """Move to ``stage`` (which counts as news from the peer); unknown ids are ignored."""
        with self._lock:
            e = self._open.get(request_id)
            if e is None or e.stage == stage:
                if e is not None:
                    e.heard_s = time.monotonic()
                return
            now = time.monotonic()
            e.stage, e.stage_since_s, e.heard_s, e.silence_limit_s = stage, now, now, silence_limit_s
            if peer is not None:
                e.peer = peer
            e.history.append((stage, now - e.opened_s))

    def touch(self, request_id: str) -> bool:
        """News from the peer the request waits for; False when the id is not open."""
        with self._lock:
            e = self._open.get(request_id)
            if e is not None:
                e.heard_s = time.monotonic()
            return e is not None

    def finish(self, request_id: str, outcome: str, error: str = "") -> bool:
        """Close the entry; False when it was not open (already finished: the first outcome stays)."""
        with self._lock:
            e = self._open.pop(request_id, None)
            if e is None:
                return False
            e.outcome, e.error = outcome, error
            e.history.append((outcome, time.monotonic() - e.opened_s))
            self._finished.append(e)
            self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1
            return True

    def stage_of(self, request_id: str) -> str | None:
        with self._lock:
            e = self._open.get(request_id)
            return e.stage if e else None

    def open_ids(self) -> list[str]:
        with self._lock:
            return list(self._open)

    # ---- the watchdog ----------------------------------------------------------------------

    def overdue(self, now: float | None = None) -> list[tuple[Entry, str]]:
        """Finish (outcome "timeout") every entry silent past its stage's limit; returns them with
        the reason. The watchdog calls this; tests may call it directly with a clock value."""
        now = time.monotonic() if now is None else now
        out = []
        with self._lock:
            for rid, e in list(self._open.items()):
                if e.silence_limit_s is None or now - e.heard_s <= e.silence_limit_s:
                    continue
                who = f"{e.peer} " if e.peer else "the peer "
                reason = (
                    f"{who}sent no news for request {rid} for {now - e.heard_s:.1f} s at stage "
                    f"{e.stage!r} (limit {e.silence_limit_s:g} s)"
                )
                del self._open[rid]
                e.outcome, e.error = "timeout", reason
                e.history.append(("timeout", now - e.opened_s))
                self._finished.append(e)
                self._outcomes["timeout"] = self._outcomes.get("timeout", 0) + 1
                out.append((e, reason))
        return out

    def start(self) -> Ledger:
        if self._on_timeout is None:
            raise ValueError("a watchdog needs on_timeout")
        self._thread = threading.Thread(
            target=self._watch, args=(self._on_timeout,), name="ledger-watchdog", daemon=True
        )
        self._thread.start()
        return self

    def _watch(self, on_timeout: Callable[[Entry, str], None]) -> None:
        last = time.monotonic()
        while not self._stop.wait(self._interval_s):
            now = time.monotonic()
            if now - last > max(1.0, 4 * self._interval_s):
                self._forgive(now - last)  # this process was stopped or starved, not the peer
            last = now
            for entry, reason in self.overdue():
                try:
                    on_timeout(entry, reason)
                except Exception:  # noqa: BLE001 - the watchdog outlives a failing callback
                    import structlog

                    structlog.get_logger(__name__).exception("watchdog_callback_failed", request_id=entry.request_id)

    def _forgive(self, gap_s: float) -> None:
        """After the watchdog itself missed ``gap_s`` seconds, silence is restarted for every open
        entry: news that arrived meanwhile has not been processed yet, so it cannot count."""
        now = time.monotonic()
        with self._lock:
            for e in self._open.values():
                e.heard_s = max(e.heard_s, now)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # ---- what Stats shows ------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        """``ledger_open``, ``ledger_open_<stage>`` and ``ledger_finished_<outcome>``."""
        with self._lock:
            out: dict[str, float] = {"ledger_open": len(self._open)}
            for e in self._open.values():
                out[f"ledger_open_{e.stage}"] = out.get(f"ledger_open_{e.stage}", 0) + 1
            for outcome, n in self._outcomes.items():
                out[f"ledger_finished_{outcome}"] = n
            return out

    def snapshot(self) -> str:
        """JSON: the open entries and the most recent finished ones."""
        now = time.monotonic()
        with self._lock:
            return json.dumps(
                {
                    "open": [e.to_dict(now) for e in self._open.values()],
                    "finished": [e.to_dict(now) for e in self._finished],
                }
            )
