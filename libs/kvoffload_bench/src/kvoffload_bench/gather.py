"""Gather bench: native ``gather_rows`` vs the torch reference vs a contiguous memcpy.

Two kinds of case, one of each per row size:

- ``cases`` (uniform): ``rows * misses_per_row`` token rows, drawn uniformly from the first
  ``context`` tokens of each row, copied into random hot-buffer slots: a large copy (16384 rows at
  the defaults) that shows the copy rate with per-call costs amortized.
- ``miss_cases`` (one real decode step's misses): the rows a decode step really gathers. The
  synthetic trace ``trace`` (``kvcore.traces.synthetic``, one layer, one stream per request,
  ``rows`` requests, top-k ``topk`` over a context of ``context`` tokens growing by one per step)
  is resolved step by step by ``kvoffload_bench.hotcache.simulate`` (LRU, the default policy;
  ``stable_lens`` = the step's context, so every miss stays resident, as in
  ``kvoffload_bench.hotcache``). After ``warmup_steps`` steps (the first one misses the whole
  top-k) the ``miss_rows``/``miss_tokens``/``miss_slots`` of each of the next ``miss_steps``
  steps are gathered unchanged: at the defaults (overlap90, k = 2048, capacity 4096) about a
  hundred rows per request, some 800 per step, well under 1 MB, so these cases measure a small
  copy where per-call costs (argument checks, thread start) weigh. Each of the ``miss_reps``
  repetitions times every measured step's three paths back to back, the path that goes first
  rotating from repetition to repetition; per step the median time gives GB/s, and the case
  reports the median over steps of each path's GB/s (``*_gbps``; ``*_gbps_per_step`` lists them)
  and their ratios. The same step's rows are copied in every repetition, so all three paths run
  with warm caches (the bytes of a step fit in L2/L3): it compares copy code, not DRAM latency.

Common to both: the host pool of at least ``pool_gib`` GiB is allocated once and touched (no page
faults are timed); token rows reach it through a random block table of distinct blocks spread over
the whole pool. The timed paths are the native gather (checks included), the torch reference's
data movement (index math, index_select, index_copy_; its Python checks excluded, which favours
torch) and ``dst.copy_(src)`` of two contiguous tensors of the same byte count; GB/s = bytes
copied / median seconds. The native result is checked against the reference (``equal``; every
measured step for the miss cases).

Goals, over the uniform cases and the miss cases together (the minimum over all of them):
``ratio_to_memcpy = min(native / memcpy) >= 0.7`` and ``speedup_vs_torch = min(native / torch) >= 1``;
``miss_ratio_to_memcpy`` and ``miss_speedup_vs_torch`` give the miss cases' minimum alone;
``outputs_equal``: the native result equal to the reference's in every case, uniform and miss
(``unequal_cases`` names any that differ).
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from kvcore.hotcache import gather
from kvcore.traces.synthetic import generate, preset
from kvoffload_bench.hotcache import simulate
from kvoffload_bench.otherload import OtherLoad

GOAL_RATIO_TO_MEMCPY = 0.7
GOAL_SPEEDUP_VS_TORCH = 1.0


def run(
    *,
    rows: int = 8,
    misses_per_row: int = 2048,
    row_bytes: tuple[int, ...] = (576, 1152),
    block_size: int = 64,
    pool_gib: float = 1.0,
    context: int = 32768,
    capacity: int = 4096,
    reps: int = 31,
    trace: str = "overlap90",
    topk: int = 2048,
    warmup_steps: int = 8,
    miss_steps: int = 5,
    miss_reps: int = 101,
    seed: int = 0,
) -> dict:
    """Runs every case; returns the JSON-ready result (see module docstring)."""
    if misses_per_row > min(context, capacity):
        raise ValueError(f"misses_per_row = {misses_per_row} exceeds min(context, capacity) = {min(context, capacity)}")
    if topk > capacity:
        raise ValueError(f"topk = {topk} exceeds capacity = {capacity}")
    if warmup_steps < 0 or miss_steps < 1 or miss_reps < 1:
        raise ValueError(
            f"warmup_steps = {warmup_steps} must be >= 0, miss_steps = {miss_steps} and miss_reps = {miss_reps} >= 1"
        )
    others = OtherLoad()
    gen = torch.Generator().manual_seed(seed)
    pool_bytes = int(pool_gib * 2**30)
    pool_flat = _touched_pool(pool_bytes, gen)
    cases = [_case(pool_flat, rows, misses_per_row, rb, block_size, context, capacity, reps, gen) for rb in row_bytes]
    steps = _miss_steps(trace, rows, topk, context, capacity, warmup_steps, miss_steps, seed)
    miss_cases = [
        _miss_case(
            pool_flat, rows, steps, rb, block_size, context + warmup_steps + miss_steps, capacity, miss_reps, gen
        )
        for rb in row_bytes
    ]
    return {
        "bench": "gather",
        "threads": gather.max_threads(),
        "torch_threads": torch.get_num_threads(),
        "pool_bytes": pool_bytes,
        **_goals(cases, miss_cases),
        "cpu_used_by_others": others.fraction(),
        "cases": cases,
        "miss_cases": miss_cases,
    }


def _goals(cases: list[dict], miss_cases: list[dict]) -> dict:
    """The figures the goals judge (each the minimum over the cases), ``goals`` and ``goals_met``."""
    every = cases + miss_cases
    ratio = min(c["ratio_to_memcpy"] for c in every)
    speedup = min(c["speedup_vs_torch"] for c in every)
    kinds = {"cases": cases, "miss_cases": miss_cases}
    unequal = [
        f"{kind}[{i}] ({c['row_bytes']} B rows)"
        for kind, cs in kinds.items()
        for i, c in enumerate(cs)
        if not c["equal"]
    ]
    return {
        "ratio_to_memcpy": ratio,
        "speedup_vs_torch": speedup,
        "miss_ratio_to_memcpy": min(c["ratio_to_memcpy"] for c in miss_cases),
        "miss_speedup_vs_torch": min(c["speedup_vs_torch"] for c in miss_cases),
        "outputs_equal": not unequal,
        "unequal_cases": unequal,
        "goals": {
            "ratio_to_memcpy": GOAL_RATIO_TO_MEMCPY,
            "speedup_vs_torch": GOAL_SPEEDUP_VS_TORCH,
            "outputs_equal": True,
        },
        "goals_met": {
            "ratio_to_memcpy": ratio >= GOAL_RATIO_TO_MEMCPY,
            "speedup_vs_torch": speedup >= GOAL_SPEEDUP_VS_TORCH,
            "outputs_equal": not unequal,
        },
    }


def _touched_pool(pool_bytes: int, gen: torch.Generator) -> torch.Tensor:
    """The host pool, flat uint8 ``[pool_bytes]``, every page touched once with varied bytes (no page
    fault is timed)."""
    pool_flat = torch.empty(pool_bytes, dtype=torch.uint8)  # [pool_bytes]
    pattern = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen)
    for start in range(0, pool_bytes, pattern.numel()):  # touch every page once, with varied bytes
        chunk = pool_flat[start : start + pattern.numel()]
        chunk.copy_(pattern[: chunk.numel()])
    return pool_flat


def _pool_view(pool_flat, rows, row_bytes, block_size, tokens, gen):
    """The pool as [num_blocks, block_size, row_bytes] and a random [rows, max_blocks] int32 block
    table of distinct blocks covering ``tokens`` tokens per row."""
    num_blocks = pool_flat.numel() // (block_size * row_bytes)
    max_blocks = -(-tokens // block_size)
    if rows * max_blocks > num_blocks:
        raise ValueError(
            f"pool of {pool_flat.numel()} bytes holds {num_blocks} blocks; "
            f"{rows} rows of {tokens} tokens need {rows * max_blocks}"
        )
    pool = pool_flat[: num_blocks * block_size * row_bytes].view(num_blocks, block_size, row_bytes)
    # block_table: [rows, max_blocks] int32, distinct blocks spread over the whole pool
    block_table = torch.randperm(num_blocks, generator=gen)[: rows * max_blocks].to(torch.int32).view(rows, max_blocks)
    return pool, block_table


def _case(pool_flat, rows, misses_per_row, row_bytes, block_size, context, capacity, reps, gen) -> dict:
    pool, block_table = _pool_view(pool_flat, rows, row_bytes, block_size, context, gen)
    M = rows * misses_per_row
    miss_rows = torch.arange(rows, dtype=torch.int32).repeat_interleave(misses_per_row)  # [M]
    miss_tokens = torch.cat([torch.randperm(context, generator=gen)[:misses_per_row] for _ in range(rows)])  # [M] int64
    miss_slots = torch.cat([torch.randperm(capacity, generator=gen)[:misses_per_row] for _ in range(rows)]).to(
        torch.int32
    )  # [M]
    dst_index = torch.randperm(rows, generator=gen).to(torch.int32)  # [rows]
    dst = torch.zeros(rows, capacity, row_bytes, dtype=torch.uint8)  # [rows, capacity, row_bytes]
    ref = torch.zeros_like(dst)
    args = (pool, block_table, miss_rows, miss_tokens)
    gather.gather_rows(*args, dst, dst_index, miss_slots, native=True)
    gather.gather_rows(*args, ref, dst_index, miss_slots, native=False)
    equal = torch.equal(dst, ref)
    src_c = torch.randint(0, 256, (M, row_bytes), dtype=torch.uint8, generator=gen)  # [M, row_bytes]
    dst_c = torch.zeros_like(src_c)
    t_native, t_torch, t_memcpy = [], [], []
    for _ in range(reps):
        t_native.append(_time(lambda: gather.gather_rows(*args, dst, dst_index, miss_slots, native=True)))
        t_torch.append(_time(lambda: gather.torch_gather(*args, ref, dst_index, miss_slots)))
        t_memcpy.append(_time(lambda: dst_c.copy_(src_c)))
    nbytes = M * row_bytes
    gbs = {
        name: nbytes / statistics.median(ts) / 1e9
        for name, ts in (("native", t_native), ("torch", t_torch), ("memcpy", t_memcpy))
    }
    return {
        "row_bytes": row_bytes,
        "block_size": block_size,
        "num_blocks": pool.shape[0],
        "rows": M,
        "bytes": nbytes,
        "native_gbps": gbs["native"],
        "torch_gbps": gbs["torch"],
        "memcpy_gbps": gbs["memcpy"],
        "ratio_to_memcpy": gbs["native"] / gbs["memcpy"],
        "speedup_vs_torch": gbs["native"] / gbs["torch"],
        "equal": equal,
    }


def _miss_steps(trace, rows, topk, context, capacity, warmup_steps, miss_steps, seed) -> dict:
    """The hot-cache misses of the measured steps of the synthetic trace ``trace`` (module docstring):
    ``{"trace": ..., "steps": [trace step], "misses": [(miss_rows, miss_tokens, miss_slots)]}``."""
    total = warmup_steps + miss_steps
    tr = generate(preset(trace, requests=rows, layers=1, steps=total, k=topk, context0=context, seed=seed), trace)
    measured = simulate(tr, capacity)[1][warmup_steps:]  # the measured steps' resolutions
    misses = [(res.miss_rows, res.miss_tokens, res.miss_slots) for res in measured]
    hits = sum(res.num_hits for res in measured)
    missed = sum(m[0].numel() for m in misses)
    return {
        "trace": trace,
        "steps": list(range(warmup_steps, total)),
        "misses": misses,
        "hit_rate": hits / max(hits + missed, 1),
    }


def _miss_case(pool_flat, rows, steps, row_bytes, block_size, tokens, capacity, reps, gen) -> dict:
    pool, block_table = _pool_view(pool_flat, rows, row_bytes, block_size, tokens, gen)
    dst_index = torch.randperm(rows, generator=gen).to(torch.int32)  # [rows]
    dst = torch.zeros(rows, capacity, row_bytes, dtype=torch.uint8)  # [rows, capacity, row_bytes] hot buffers
    ref = torch.zeros_like(dst)
    equal = True
    paths = []  # per step: {name: fn}
    for miss_rows, miss_tokens, miss_slots in steps["misses"]:  # [M] int32, [M] int64, [M] int32
        args = (pool, block_table, miss_rows, miss_tokens, dst, dst_index, miss_slots)
        gather.gather_rows(*args, native=True)
        gather.gather_rows(pool, block_table, miss_rows, miss_tokens, ref, dst_index, miss_slots, native=False)
        equal &= torch.equal(dst, ref)
        src_c = torch.randint(
            0, 256, (miss_rows.numel(), row_bytes), dtype=torch.uint8, generator=gen
        )  # [M, row_bytes]
        dst_c = torch.zeros_like(src_c)
        paths.append(
            {
                "native": partial(gather.gather_rows, *args, native=True),
                "torch": partial(
                    gather.torch_gather, pool, block_table, miss_rows, miss_tokens, ref, dst_index, miss_slots
                ),
                "memcpy": partial(dst_c.copy_, src_c),
            }
        )
    names = ("native", "torch", "memcpy")
    times: list[dict[str, list[float]]] = [{name: [] for name in names} for _ in paths]  # per step, per path: seconds
    for rep in range(reps):
        order = names[rep % 3 :] + names[: rep % 3]  # the path that goes first rotates
        for fns, ts in zip(paths, times):
            for name in order:
                ts[name].append(_time(fns[name]))
    counts = [m[0].numel() for m in steps["misses"]]
    per_step = {
        name: [n * row_bytes / statistics.median(ts[name]) / 1e9 for n, ts in zip(counts, times)] for name in names
    }
    gbs = {name: statistics.median(v) for name, v in per_step.items()}
    return {
        "row_bytes": row_bytes,
        "block_size": block_size,
        "num_blocks": pool.shape[0],
        "trace": steps["trace"],
        "steps": steps["steps"],
        "hit_rate": steps["hit_rate"],  # of the measured steps
        "rows_per_step": counts,
        "rows": statistics.median(counts),
        "bytes_per_step": [n * row_bytes for n in counts],
        "reps": reps,
        "native_gbps": gbs["native"],
        "torch_gbps": gbs["torch"],
        "memcpy_gbps": gbs["memcpy"],
        "native_gbps_per_step": per_step["native"],
        "torch_gbps_per_step": per_step["torch"],
        "memcpy_gbps_per_step": per_step["memcpy"],
        "ratio_to_memcpy": gbs["native"] / gbs["memcpy"],
        "speedup_vs_torch": gbs["native"] / gbs["torch"],
        "equal": equal,
    }


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
