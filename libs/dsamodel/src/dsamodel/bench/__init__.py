"""Engine benchmarks of the tiny model (``kvoffload bench prefill|prefix|decode --json``).

Each module exposes ``run(**params) -> dict``: both sides of a comparison run in the same
process, interleaved, and the report gives ratios (absolute times on shared machines are noise)
plus the goals as booleans in ``goals_met``.

- ``prefill``  layerwise buffer reuse vs no reuse, on a deep tiny model.
- ``prefix``   the prefix cache: a second request on a shared prefix vs the first.
- ``decode``   sparse offload vs ``keep_device_kv_cache``, on prompts or on a top-k trace (I2).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import structlog


def quiet_logs() -> None:
    """Benchmarks print one JSON document on stdout: the engines' info logs are dropped, and their
    warnings and errors go to stderr (the ``sys.stderr`` of the moment each is logged)."""
    import logging
    import sys

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr))


def interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds per call of each function, the functions alternating in every repetition."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}
