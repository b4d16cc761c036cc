"""Prefill bench: layerwise buffer reuse (B=3 + independent [0]) vs no reuse ("all"), tiny model.

Both engines prefill the same prompt, alternating, several times; ``time_ratio`` = median reuse
time / median no-reuse time (goal <= 1.10: with loads and saves overlapping compute, reuse costs
little time) and ``device_kv_ratio`` = peak device KV bytes with reuse / without, measured by the
counting allocator (goal: (I + B) / N within 1%).
"""

from __future__ import annotations

import torch

from dsamodel.bench import interleaved, quiet_logs
from dsamodel.engine import build
from dsamodel.engine.prefill import PrefillRequest
from dsamodel.presets import tiny_model

GOAL_TIME_RATIO = 1.10


def run(*, prompt_tokens: int = 8192, chunk_size: int = 2048, block_size: int = 64, buffers: int = 3,
        reps: int = 3, dtype: str = "bfloat16", seed: int = 0) -> dict:
    quiet_logs()
    model = tiny_model(seed=seed, dtype="float32").to(getattr(torch, dtype))
    prompt = torch.randint(0, 256, (prompt_tokens,), generator=torch.Generator().manual_seed(seed))
    n = len(model.cache_layers)
    engines, pools = {}, []
    for name, b, indep in (("reuse", buffers, [0]), ("no_reuse", None, "all")):
        pool = build.prefill_pool(model, block_size, 4 * prompt_tokens * _token_bytes(model) + (64 << 20))
        pools.append(pool)
        engines[name] = build.prefill_engine(model, pool, buffers=b, independent=indep, chunk_size=chunk_size,
                                             max_model_len=prompt_tokens, model_id=f"bench-{name}")
    counter = iter(range(1 << 30))
    logits = {}

    def prefill(name):
        def go():
            eng = engines[name]
            res = eng.run(PrefillRequest(f"{name}-{next(counter)}", prompt))
            logits[name] = res.logits
            eng.release(res)
            eng.pool.remove(res.keys)  # the next repetition recomputes instead of hitting the prefix cache
        return go

    try:
        prefill("reuse")()  # warm-up
        prefill("no_reuse")()
        t = interleaved({name: prefill(name) for name in engines}, reps)
        dev = {name: e.allocator.stats().peak_by_tag for name, e in engines.items()}
        bytes_of = {name: sum(v for k, v in d.items() if k.startswith("prefill.")) for name, d in dev.items()}
        plan = engines["reuse"].plan
        expected = plan.num_buffers / n
        device_kv_ratio = bytes_of["reuse"] / bytes_of["no_reuse"]
        return {
            "bench": "prefill", "prompt_tokens": prompt_tokens, "chunk_size": chunk_size, "block_size": block_size,
            "num_logical_layers": n, "num_buffers": plan.num_buffers, "dtype": dtype,
            "reuse_s": t["reuse"], "no_reuse_s": t["no_reuse"],
            "time_ratio": t["reuse"] / t["no_reuse"],
            "device_kv_bytes": bytes_of["reuse"], "device_kv_bytes_no_reuse": bytes_of["no_reuse"],
            "device_kv_ratio": device_kv_ratio, "expected_device_kv_ratio": expected,
            "logits_equal": bool(torch.equal(logits["reuse"], logits["no_reuse"])),
            "goals_met": {"time_ratio": t["reuse"] / t["no_reuse"] <= GOAL_TIME_RATIO,
                          "device_kv_ratio": abs(device_kv_ratio - expected) <= 0.01 * expected},
        }
    finally:
        for e in engines.values():
            e.close()
        for p in pools:
            p.close()


def _token_bytes(model) -> int:
    c = model.config
    return len(model.cache_layers) * (c.kv_row_width + c.index_head_dim) * model.dtype.itemsize
