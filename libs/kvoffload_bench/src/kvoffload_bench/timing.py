"""How the engine benches (``prefill``, ``prefix``, ``decode``) time both sides of a comparison: in
the same process, interleaved, so that the report's ratios hold on shared machines (where absolute
times are noise)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds per call of each function, the functions alternating in every repetition."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}
