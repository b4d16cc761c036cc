"""Hot-cache bench: native ``HotCache.resolve`` vs the best vectorized torch code of the same
semantics, and vs the Python reference, on synthetic top-k traces.

Per case (one adjacent-step overlap): every row draws its first top-k uniformly from ``context``
tokens; each later step keeps ``overlap`` of the previous top-k and draws the rest fresh from the
tokens not in it, in shuffled order. Three paths resolve the same trace (``warmup`` untimed steps
first): the native C++/OpenMP path, ``TorchHotCache`` (``kvcore.bench.hotcache_torch``: whole-tensor
torch ops over all rows and entries, no Python loop over rows or tokens, proven equal to the
reference by a property test) and the Python reference. Torch runs at 1 intra-op thread and at
the process's count (``torch_threads_tried``), alternating from step to step; the faster median
counts (``torch_threads``), both are reported. Step by step the native and torch paths are timed
back to back, in turn first, then the reference (only on its first ``reference_steps`` steps,
it is slow).
``outputs_equal`` (per case): native == reference on every step the reference ran;
``torch_outputs_equal``: torch == reference on those steps and torch == native on every step; the
top-level ``outputs_equal`` is all of them. Medians give seconds per step, and
``entries_per_s = rows * topk / native seconds``.

Goals: ``speedup = min(reference / native) >= 10`` (the C++ against plain Python),
``speedup_vs_torch = min(torch / native) >= 1`` (the C++ is not slower than the best torch code
of the same semantics: the baseline that says whether the native extension earns its keep) and
``entries_per_s = min(...) >= 1e8``.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvcore.bench.hotcache_torch import TorchHotCache
from kvcore.bench.load import OtherLoad
from kvcore.hotcache import HotCache, Resolution, max_threads

GOAL_SPEEDUP = 10.0
GOAL_SPEEDUP_VS_TORCH = 1.0
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
    vs_torch = min(c["speedup_vs_torch"] for c in cases)
    entries = min(c["entries_per_s"] for c in cases)
    return {
        "bench": "hotcache",
        "threads": max_threads(),
        "torch_threads_tried": sorted({1, torch.get_num_threads()}),
        "rows": rows,
        "topk": topk,
        "capacity": capacity,
        "context": context,
        "speedup": speedup,
        "speedup_vs_torch": vs_torch,
        "entries_per_s": entries,
        "outputs_equal": all(c["outputs_equal"] and c["torch_outputs_equal"] for c in cases),
        "goals": {
            "speedup": GOAL_SPEEDUP,
            "speedup_vs_torch": GOAL_SPEEDUP_VS_TORCH,
            "entries_per_s": GOAL_ENTRIES_PER_S,
        },
        "cpu_used_by_others": others.fraction(),
        "goals_met": {
            "speedup": speedup >= GOAL_SPEEDUP,
            "speedup_vs_torch": vs_torch >= GOAL_SPEEDUP_VS_TORCH,
            "entries_per_s": entries >= GOAL_ENTRIES_PER_S,
        },
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
    threads = sorted({1, torch.get_num_threads()})  # torch's intra-op threads, alternating by step
    native, vec = HotCache(capacity, 1, native=True), TorchHotCache(capacity, 1)
    ref = HotCache(capacity, 1, native=False)
    equal = torch_equal = True
    for t in range(warmup):
        rres = ref.resolve(0, ids, tr[t], stable)
        equal &= _same(native.resolve(0, ids, tr[t], stable), rres)
        torch_equal &= _same(vec.resolve(0, ids, tr[t], stable), rres)
    times: dict[str, list[float]] = {name: [] for name in ["native", *(f"torch{n}" for n in threads), "reference"]}
    hits = misses = 0
    for t in range(warmup, warmup + steps):
        vec.threads = threads[t % len(threads)]
        paths = [("native", native), (f"torch{vec.threads}", vec)]
        out = {}
        for name, path in paths if (t // len(threads)) % 2 == 0 else paths[::-1]:  # back to back, in turn first
            t0 = time.perf_counter()
            out[name] = path.resolve(0, ids, tr[t], stable)
            times[name].append(time.perf_counter() - t0)
        res, tres = out["native"], out[f"torch{vec.threads}"]
        torch_equal &= _same(tres, res)
        hits, misses = hits + res.num_hits, misses + res.num_misses
        if t - warmup < reference_steps:
            t0 = time.perf_counter()
            rres = ref.resolve(0, ids, tr[t], stable)
            times["reference"].append(time.perf_counter() - t0)
            equal &= _same(res, rres)
            torch_equal &= _same(tres, rres)
    med = {name: statistics.median(ts) for name, ts in times.items() if ts}
    threads = [n for n in threads if f"torch{n}" in med]  # (a single step times one count only)
    by_threads = {str(n): med[f"torch{n}"] for n in threads}
    best = min(threads, key=lambda n: med[f"torch{n}"])
    native_s, torch_s, ref_s = med["native"], med[f"torch{best}"], med["reference"]
    return {
        "overlap": overlap,
        "steps": steps,
        "reference_steps": reference_steps,
        "native_s_per_step": native_s,
        "torch_s_per_step": torch_s,
        "torch_threads": best,
        "torch_s_per_step_by_threads": by_threads,
        "reference_s_per_step": ref_s,
        "speedup": ref_s / native_s,
        "speedup_vs_torch": torch_s / native_s,
        "entries_per_s": rows * topk / native_s,
        "hit_rate": hits / max(hits + misses, 1),
        "outputs_equal": equal,
        "torch_outputs_equal": torch_equal,
    }


def _same(a: Resolution, b: Resolution) -> bool:
    return (
        a.num_hits == b.num_hits
        and a.num_misses == b.num_misses
        and all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("slots", "miss_rows", "miss_tokens", "miss_slots"))
    )


