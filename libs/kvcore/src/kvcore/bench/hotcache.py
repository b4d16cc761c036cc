"""Hot-cache bench: native vs Python-reference ``HotCache.resolve`` on synthetic top-k traces.

Per case (one adjacent-step overlap): every row draws its first top-k uniformly from ``context``
tokens; each later step keeps ``overlap`` of the previous top-k and draws the rest fresh from the
tokens not in it, in shuffled order. Both paths resolve the same trace (``warmup`` untimed steps
first); step by step the native path is timed, then the reference (only on its first
``reference_steps`` steps, it is slow), and their outputs compared (``outputs_equal``). Medians
give seconds per step; ``entries_per_s = rows * topk / native seconds``. Goals: ``speedup =
min(reference / native) >= 10`` and ``entries_per_s = min(...) >= 1e8``.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvcore.bench import OtherLoad
from kvcore.hotcache import HotCache, Resolution, max_threads

GOAL_SPEEDUP = 10.0
GOAL_ENTRIES_PER_S = 1e8


def run(
    *,
    rows: int = 8,
    topk: int = 2048,
    capacity: int = 4096,
    context: int = 32768,
    overlaps: tuple[float, ...] = (0.6, 0.9, 0.98),
    steps: int = 100,
    reference_steps: int = 5,
    warmup: int = 3,
    seed: int = 0,
) -> dict:
    """Runs every case; returns the JSON-ready result (see module docstring)."""
    if topk > min(capacity, context):
        raise ValueError(f"topk = {topk} exceeds min(capacity, context) = {min(capacity, context)}")
    gen = torch.Generator().manual_seed(seed)
    others = OtherLoad()
    cases = [_case(rows, topk, capacity, context, ov, steps, min(reference_steps, steps), warmup, gen) for ov in overlaps]
    speedup = min(c["speedup"] for c in cases)
    entries = min(c["entries_per_s"] for c in cases)
    return {
        "bench": "hotcache",
        "threads": max_threads(),
        "rows": rows,
        "topk": topk,
        "capacity": capacity,
        "context": context,
        "speedup": speedup,
        "entries_per_s": entries,
        "goals": {"speedup": GOAL_SPEEDUP, "entries_per_s": GOAL_ENTRIES_PER_S},
        "cpu_used_by_others": others.fraction(),
        "goals_met": {"speedup": speedup >= GOAL_SPEEDUP, "entries_per_s": entries >= GOAL_ENTRIES_PER_S},
        "cases": cases,
    }


def trace(rows: int, topk: int, context: int, overlap: float, steps: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``steps`` top-k tensors [rows, topk] int64 with adjacent-step overlap ``overlap``."""
    n_keep = round(overlap * topk)
    cur = torch.rand(rows, context, generator=gen).topk(topk, dim=1).indices  # [rows, topk]
    out = [cur]
    for _ in range(steps - 1):
        keep_pos = torch.rand(rows, topk, generator=gen).argsort(dim=1)[:, :n_keep]  # [rows, n_keep]
        kept = cur.gather(1, keep_pos)
        scores = torch.rand(rows, context, generator=gen).scatter_(1, cur, -1.0)  # exclude previous top-k
        fresh = scores.topk(topk - n_keep, dim=1).indices  # [rows, topk - n_keep]
        nxt = torch.cat([kept, fresh], dim=1)
        cur = nxt.gather(1, torch.rand(rows, topk, generator=gen).argsort(dim=1))  # shuffled order
        out.append(cur)
    return out


def _case(rows, topk, capacity, context, overlap, steps, reference_steps, warmup, gen) -> dict:
    tr = trace(rows, topk, context, overlap, warmup + steps, gen)
    ids = [f"req-{r}" for r in range(rows)]
    stable = [context] * rows
    native, ref = HotCache(capacity, 1, native=True), HotCache(capacity, 1, native=False)
    equal = True
    for t in range(warmup):
        equal &= _same(native.resolve(0, ids, tr[t], stable), ref.resolve(0, ids, tr[t], stable))
    t_native, t_ref, hits, misses = [], [], 0, 0
    for t in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        res = native.resolve(0, ids, tr[t], stable)
        t_native.append(time.perf_counter() - t0)
        hits, misses = hits + res.num_hits, misses + res.num_misses
        if t - warmup < reference_steps:
            t0 = time.perf_counter()
            rres = ref.resolve(0, ids, tr[t], stable)
            t_ref.append(time.perf_counter() - t0)
            equal &= _same(res, rres)
    native_s, ref_s = statistics.median(t_native), statistics.median(t_ref)
    return {
        "overlap": overlap,
        "steps": steps,
        "reference_steps": reference_steps,
        "native_s_per_step": native_s,
        "reference_s_per_step": ref_s,
        "speedup": ref_s / native_s,
        "entries_per_s": rows * topk / native_s,
        "hit_rate": hits / max(hits + misses, 1),
        "outputs_equal": equal,
    }


def _same(a: Resolution, b: Resolution) -> bool:
    return (
        a.num_hits == b.num_hits
        and a.num_misses == b.num_misses
        and all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("slots", "miss_rows", "miss_tokens", "miss_slots"))
    )


