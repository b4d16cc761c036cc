"""Decode bench: sparse offload vs keep_device_kv_cache, batch 8, context 8192, tiny model.

Two engines hold the same 8 requests (an 8000-token shared prefix plus distinct suffixes, so the
prefix cache keeps set-up short); their decode steps alternate. ``step_time_ratio`` = median
sparse step / median keep step (goal <= 1.25 on CPU), ``device_kv_ratio`` = device KV bytes
(indexer cache + hot buffers vs indexer cache + full KV, from the counting allocator; goal <= 0.2),
``hit_rate`` and ``h2d_bytes_per_step`` of the sparse engine, and whether both engines' logits
were bit-identical at every step (I2).
"""

from __future__ import annotations

import statistics
import time

import torch

from dsamodel.bench import quiet_logs
from dsamodel.engine.engine import Engine, EngineConfig
from dsamodel.presets import tiny_model
from dsamodel.sampling import SamplingParams

GOAL_STEP_TIME_RATIO = 1.25
GOAL_DEVICE_KV_RATIO = 0.2


def run(*, batch: int = 8, context: int = 8192, steps: int = 32, topk_buffer_size: int = 128,
        block_size: int = 64, dtype: str = "bfloat16", seed: int = 0) -> dict:
    quiet_logs()
    model = tiny_model(seed=seed, dtype="float32").to(getattr(torch, dtype))
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 256, (context - 192,), generator=gen)
    prompts = [torch.cat((shared, torch.randint(0, 256, (191,), generator=gen))) for _ in range(batch)]
    engines = {}
    for name, keep in (("sparse", False), ("keep", True)):
        cfg = EngineConfig(block_size=block_size, max_model_len=context + steps + 8, max_num_seqs=batch,
                           chunk_size=2048, buffers=3, topk_buffer_size=topk_buffer_size,
                           keep_device_kv_cache=keep, prefill_pool_bytes=1 << 30, decode_pool_bytes=1 << 30)
        eng = Engine(model, cfg)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=steps + 2, ignore_eos=True))
        eng.step()  # prefill all (the prefix cache makes requests 2..8 cheap) + the first decode step
        engines[name] = eng
    times: dict[str, list[float]] = {"sparse": [], "keep": []}
    logits: dict[str, torch.Tensor] = {}
    hits = misses = h2d = 0
    equal = True
    try:
        for name, eng in engines.items():  # capture each step's logits
            real = eng.decoder.forward

            def recorded(ids, tokens, _real=real, _name=name):
                out = _real(ids, tokens)
                logits[_name] = out[0]
                return out

            eng.decoder.forward = recorded
        for _ in range(steps):
            for name, eng in engines.items():
                t = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t)
            equal &= bool(torch.equal(logits["sparse"], logits["keep"]))
            st = engines["sparse"].decoder.last_step
            hits, misses, h2d = hits + st.hits, misses + st.misses, h2d + st.h2d_bytes
        dev = {name: sum(v for k, v in e.allocator.stats().current_by_tag.items() if k.startswith("decode."))
               for name, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()
    ratio = statistics.median(times["sparse"]) / statistics.median(times["keep"])
    device_ratio = dev["sparse"] / dev["keep"]
    return {
        "bench": "decode", "batch": batch, "context": context, "steps": steps, "dtype": dtype,
        "topk": model.config.index_topk, "topk_buffer_size": topk_buffer_size,
        "sparse_step_s": statistics.median(times["sparse"]), "keep_step_s": statistics.median(times["keep"]),
        "step_time_ratio": ratio,
        "device_kv_bytes": dev["sparse"], "device_kv_bytes_keep": dev["keep"], "device_kv_ratio": device_ratio,
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "h2d_bytes_per_step": h2d / steps,
        "logits_equal": equal,
        "goals_met": {"step_time_ratio": ratio <= GOAL_STEP_TIME_RATIO,
                      "device_kv_ratio": device_ratio <= GOAL_DEVICE_KV_RATIO},
    }
