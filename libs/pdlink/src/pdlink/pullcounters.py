"""The counters of a consumer's pulls (``COUNTERS``, and the bytes read per prefill TP rank), safe
to update from many threads. The decode reads them as a snapshot (its Stats and /metrics), a vLLM
decode as the sums since its last report (``take``)."""

from __future__ import annotations

import threading

__all__ = ["BY_RANK", "COUNTERS", "PullCounters"]

COUNTERS = {  # name -> meaning (the names are what Stats and /metrics expose)
    "read_done": "ReadReady answered READ_DONE after a pull (a duplicate answered from installed rows is not)",
    "read_failed": "ReadReady answered READ_FAILED",
    "read_retries": "retries of a failed read of the source",
    "bytes_read": "bytes pulled and installed (main + indexer rows) by the READ_DONE pulls",
    "read_ms_total": "ms the READ_DONE pulls spent moving data (reading the source + installing the rows)",
    "reads_shared_memory": "plane reads out of the prefill's shared-memory buffer (retries included)",
    "reads_streamed": "plane reads streamed from the prefill's LayerSource (retries included)",
    "reads_engine": "layer reads (all planes in one) through a transfer engine, memfabric or mooncake (retries too)",
    "heartbeats": "Heartbeat messages taken",
}
# and, per prefill TP rank r whose rows this decode pulled, ``bytes_read_prefill_tp_rank_<r>``: the
# part of bytes_read read out of that rank's layer buffers (the ranks of a contributor group send
# their shares of every layer; the parts sum to bytes_read)
BY_RANK = "bytes_read_prefill_tp_rank_"


class PullCounters:
    """``COUNTERS`` and the bytes by prefill TP rank: every change, ``snapshot`` and ``take`` holds one
    lock, so none of them ever sees half of an ``add``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = _zeros()
        self._by_rank: dict[int, float] = {}

    def increment(self, name: str) -> None:
        self.add(**{name: 1})

    def add_read(self, prefill_tp_rank: int, nbytes: int, ms: float) -> None:
        """One READ_DONE pull of ``nbytes`` out of prefill TP rank ``prefill_tp_rank``'s buffers."""
        with self._lock:
            self._values["read_done"] += 1
            self._values["bytes_read"] += nbytes
            self._values["read_ms_total"] += ms
            self._by_rank[prefill_tp_rank] = self._by_rank.get(prefill_tp_rank, 0) + nbytes

    def add(self, **amounts: float) -> None:
        """Add to one or more counters at once (KeyError, and nothing added, for an unknown name)."""
        unknown = [name for name in amounts if name not in self._values]
        if unknown:
            raise KeyError(f"unknown counter(s) {unknown}; known: {list(self._values)}")
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict[str, float]:
        """A copy of every counter, taken at one instant."""
        with self._lock:
            return self._copy()

    def take(self) -> dict[str, float]:
        """Every counter, then all back to 0 (the sums since the last ``take``), at one instant."""
        with self._lock:
            data = self._copy()
            self._values, self._by_rank = _zeros(), {}
        return data

    def _copy(self) -> dict[str, float]:
        return {**self._values, **{f"{BY_RANK}{r}": b for r, b in sorted(self._by_rank.items())}}


def _zeros() -> dict[str, float]:
    """Every counter at 0 (the milliseconds as a float)."""
    return {name: 0.0 if name == "read_ms_total" else 0 for name in COUNTERS}
