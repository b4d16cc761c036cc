"""``OtherLoad``: how much of the machine other processes used while a bench ran."""

from __future__ import annotations

import os
import time


class OtherLoad:
    """How much of the machine other processes used while a bench ran: on a shared machine their
    load explains noisy ratios. ``fraction()`` = (machine busy CPU time - this process's CPU time)
    / (wall time * CPUs), from /proc/stat and os.times(); None where /proc/stat is missing."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:8]]
        except (OSError, ValueError):
            return None
        hz = os.sysconf("SC_CLK_TCK")
        busy = (sum(fields) - fields[3] - fields[4]) / hz  # all but idle and iowait, seconds
        t = os.times()
        return busy, t.user + t.system, time.monotonic()

    def fraction(self) -> float | None:
        end = self._read()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        others = (end[0] - self._start[0]) - (end[1] - self._start[1])
        share = others / ((end[2] - self._start[2]) * (os.cpu_count() or 1))
        return round(min(max(share, 0.0), 1.0), 3)
