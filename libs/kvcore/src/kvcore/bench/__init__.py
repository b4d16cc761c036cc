"""Side-by-side benchmarks of kvcore's native paths (``kvoffload bench NAME --json``).

Each module exposes ``run(**params) -> dict``: keyword parameters with production-like defaults,
native and reference measured in the same run with interleaved repetitions, medians reported, and
the goals as booleans in ``goals_met``. Nothing is printed; absolute times on shared machines are
noise, so every headline number is a ratio or a rate measured next to its baseline.

- ``hotcache``: native vs vectorized torch (``hotcache_torch``) vs Python-reference ``HotCache.resolve``
  on synthetic top-k traces.
- ``gather``: native ``gather_rows`` vs the torch reference vs a contiguous memcpy of the same bytes.
- ``load``: ``OtherLoad``, how much of the machine other processes used while a bench ran.
"""

from kvcore.bench import gather, hotcache
from kvcore.bench.load import OtherLoad

BENCHES = {"hotcache": hotcache.run, "gather": gather.run}

__all__ = ["BENCHES", "OtherLoad", "gather", "hotcache"]
