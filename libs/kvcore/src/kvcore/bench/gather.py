"""Gather bench: native ``gather_rows`` vs the torch reference vs a contiguous memcpy.

Per case (one row size): ``rows * misses_per_row`` token rows scattered over a host pool of at
least ``pool_gib`` GiB (allocated once and touched, so no page faults are timed) through a random
block table, copied into random hot-buffer slots. Each repetition times, back to back, the native
gather (checks included), the torch reference's data movement (index math, index_select,
index_copy_; its Python checks excluded, which favours torch) and ``dst.copy_(src)`` of two
contiguous tensors of the same byte count; the medians give GB/s (bytes copied / second). Goals:
``ratio_to_memcpy = min(native / memcpy) >= 0.7`` and ``speedup_vs_torch = min(native / torch) >= 1``.
The native result is checked once against the reference (``equal``).
"""

from __future__ import annotations

import statistics
import time

import torch

from kvcore.bench.load import OtherLoad
from kvcore import gather

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
    seed: int = 0,
) -> dict:
    """Runs every case; returns the JSON-ready result (see module docstring)."""
    if misses_per_row > min(context, capacity):
        raise ValueError(f"misses_per_row = {misses_per_row} exceeds min(context, capacity) = {min(context, capacity)}")
    others = OtherLoad()
    gen = torch.Generator().manual_seed(seed)
    pool_bytes = int(pool_gib * 2**30)
    pool_flat = torch.empty(pool_bytes, dtype=torch.uint8)  # [pool_bytes]
    pattern = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen)
    for start in range(0, pool_bytes, pattern.numel()):  # touch every page once, with varied bytes
        chunk = pool_flat[start : start + pattern.numel()]
        chunk.copy_(pattern[: chunk.numel()])
    cases = [_case(pool_flat, rows, misses_per_row, rb, block_size, context, capacity, reps, gen) for rb in row_bytes]
    ratio = min(c["ratio_to_memcpy"] for c in cases)
    speedup = min(c["speedup_vs_torch"] for c in cases)
    return {
        "bench": "gather",
        "threads": gather.max_threads(),
        "torch_threads": torch.get_num_threads(),
        "pool_bytes": pool_bytes,
        "ratio_to_memcpy": ratio,
        "speedup_vs_torch": speedup,
        "goals": {"ratio_to_memcpy": GOAL_RATIO_TO_MEMCPY, "speedup_vs_torch": GOAL_SPEEDUP_VS_TORCH},
        "cpu_used_by_others": others.fraction(),
        "goals_met": {"ratio_to_memcpy": ratio >= GOAL_RATIO_TO_MEMCPY, "speedup_vs_torch": speedup >= GOAL_SPEEDUP_VS_TORCH},
        "cases": cases,
    }


def _case(pool_flat, rows, misses_per_row, row_bytes, block_size, context, capacity, reps, gen) -> dict:
    num_blocks = pool_flat.numel() // (block_size * row_bytes)
    max_blocks = -(-context // block_size)
    if rows * max_blocks > num_blocks:
        raise ValueError(f"pool of {pool_flat.numel()} bytes holds {num_blocks} blocks; {rows} rows of {context} tokens need {rows * max_blocks}")
    pool = pool_flat[: num_blocks * block_size * row_bytes].view(num_blocks, block_size, row_bytes)
    # block_table: [rows, max_blocks] int32, distinct blocks spread over the whole pool
    block_table = torch.randperm(num_blocks, generator=gen)[: rows * max_blocks].to(torch.int32).view(rows, max_blocks)
    M = rows * misses_per_row
    miss_rows = torch.arange(rows, dtype=torch.int32).repeat_interleave(misses_per_row)  # [M]
    miss_tokens = torch.cat([torch.randperm(context, generator=gen)[:misses_per_row] for _ in range(rows)])  # [M] int64
    miss_slots = torch.cat([torch.randperm(capacity, generator=gen)[:misses_per_row] for _ in range(rows)]).to(torch.int32)  # [M]
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
    gbs = {name: nbytes / statistics.median(ts) / 1e9 for name, ts in
           (("native", t_native), ("torch", t_torch), ("memcpy", t_memcpy))}
    return {
        "row_bytes": row_bytes,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "rows": M,
        "bytes": nbytes,
        "native_gbps": gbs["native"],
        "torch_gbps": gbs["torch"],
        "memcpy_gbps": gbs["memcpy"],
        "ratio_to_memcpy": gbs["native"] / gbs["memcpy"],
        "speedup_vs_torch": gbs["native"] / gbs["torch"],
        "equal": equal,
    }


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
