"""The prefix cache's reset (``/reset_prefix_cache``), one implementation for both modes (a P/D
prefill's ``PrefillWorker`` and offload-only's ``GenerateLoop``): remove the objects the prompts
wrote or reused from the host pool, except those being read right now."""

from __future__ import annotations

from collections.abc import Iterable

from kvcore.pool.host_pool import ObjectLeased


def remove_unleased(pool, keys: Iterable[bytes]) -> tuple[dict[str, int], list[bytes]]:
    """Remove each of ``keys`` from ``pool``, except those being read now (``ObjectLeased``: kept).
    Returns the removed / kept counts and the keys kept (still prefix cache)."""
    removed, kept = 0, []
    for key in keys:
        try:
            pool.remove([key])
            removed += 1
        except ObjectLeased:
            kept.append(key)
    return {"removed": removed, "kept_leased": len(kept)}, kept
