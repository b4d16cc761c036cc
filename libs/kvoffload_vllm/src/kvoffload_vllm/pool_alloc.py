"""Pool objects for one step's saves of the store connector: the blocks the pool lacks.

A block the pool has already, or one another engine is writing right now (``ObjectExists`` at
``alloc``), is left out: that copy will do. A pool that refuses (full, its MetaStore down) skips
the request's blocks: they are simply not cached, and the caller counts and logs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvcore.pool.host_pool import HostPoolBackend, ObjectExists, PoolError
from kvoffload_vllm.plan import Transfer


def allocate(
    pools: Sequence[HostPoolBackend], saves: list[Transfer]
) -> tuple[list[Transfer], list[tuple[Transfer, PoolError]]]:
    """(the saves to write, each in objects now allocated in its KV cache group's pool ``pools[group]``;
    the saves skipped, with why)."""
    out, skipped = [], []
    for t in saves:
        pool = pools[t.group]
        try:
            present = pool.exists(list(t.keys))
            keep = [(k, b) for k, b, p in zip(t.keys, t.block_ids, present, strict=True) if not p]
            while keep:
                try:
                    pool.alloc([k for k, _ in keep])
                    break
                except ObjectExists as exc:  # being written by another engine: theirs will do
                    keep = [(k, b) for k, b in keep if k != exc.key]
                    if exc.key is None:
                        raise
            if keep:
                out.append(
                    replace(t, keys=tuple(k for k, _ in keep), block_ids=tuple(b for _, b in keep))
                )  # its group kept
        except PoolError as exc:
            skipped.append((t, exc))
    return out, skipped
