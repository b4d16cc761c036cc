"""Prefix-cache bench: a 4096-token shared prefix + 256-token suffix, second request vs first.

The first request computes everything; the second finds the prefix's blocks in the host pool and
computes only its suffix. ``ttft_ratio`` = second prefill time / first (goal <= 0.2), each the
median over repetitions on fresh pools, alternating.
"""

from __future__ import annotations

import statistics
import time

import torch

from dsamodel.presets import tiny_model
from kvoffload_engine import build
from kvoffload_engine.prefill import PrefillRequest
from svcruntime.logs import quiet_logs

GOAL_TTFT_RATIO = 0.2


def run(
    *,
    prefix_tokens: int = 4096,
    suffix_tokens: int = 256,
    chunk_size: int = 2048,
    block_size: int = 64,
    reps: int = 3,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> dict:
    quiet_logs()
    model = tiny_model(seed=seed, dtype="float32").to(getattr(torch, dtype))
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 256, (prefix_tokens,), generator=gen)
    first = torch.cat((prefix, torch.randint(0, 256, (suffix_tokens,), generator=gen)))
    second = torch.cat((prefix, torch.randint(0, 256, (suffix_tokens,), generator=gen)))
    total = prefix_tokens + suffix_tokens
    times: dict[str, list[float]] = {"first": [], "second": []}
    computed = {}
    for rep in range(reps + 1):  # the first round warms up
        pool = build.prefill_pool(model, block_size, 64 << 20)
        eng = build.prefill_engine(
            model, pool, buffers=3, independent=[0], chunk_size=chunk_size, max_model_len=total, model_id="bench-prefix"
        )
        try:
            for name, prompt in (("first", first), ("second", second)):
                t = time.perf_counter()
                res = eng.run(PrefillRequest(f"{name}-{rep}", prompt))
                dt = time.perf_counter() - t
                eng.release(res)
                computed[name] = res.num_computed_tokens
                if rep:
                    times[name].append(dt)
        finally:
            eng.close()
            pool.close()
    first_s, second_s = statistics.median(times["first"]), statistics.median(times["second"])
    return {
        "bench": "prefix",
        "prefix_tokens": prefix_tokens,
        "suffix_tokens": suffix_tokens,
        "dtype": dtype,
        "first_s": first_s,
        "second_s": second_s,
        "ttft_ratio": second_s / first_s,
        "first_computed_tokens": computed["first"],
        "second_computed_tokens": computed["second"],
        "goals_met": {"ttft_ratio": second_s / first_s <= GOAL_TTFT_RATIO},
    }
