"""The decode bench's report (``kvoffload_bench.decode``): its goals, the sparse decoder's summed
``StepStats``, the device KV read from the counting allocator, and the JSON both modes (prompts,
trace) return: step-time, device-KV and H2D-floor ratios, each judged against its goal."""

from __future__ import annotations

import statistics

from kvoffload_engine.decode import StepStats

GOAL_STEP_TIME_RATIO = 1.25
GOAL_STEP_TIME_RATIO_TRACE = 1.10
GOAL_DEVICE_KV_RATIO = 0.2
GOAL_H2D_FLOOR_RATIO = 1.02


def add_stats(total: StepStats, st: StepStats) -> None:
    """``st``'s counters added into ``total``."""
    total.hits += st.hits
    total.misses += st.misses
    total.h2d_bytes += st.h2d_bytes
    total.prefetched += st.prefetched
    total.prefetch_hits += st.prefetch_hits
    total.load_s += st.load_s


def device_kv(allocator) -> int:
    """Device bytes of the decode's KV (its allocations tagged ``decode.*``)."""
    return sum(v for k, v in allocator.stats().current_by_tag.items() if k.startswith("decode."))


def report(
    *, trace, model, batch, context, steps, dtype, topk_buffer_size, times, dev, total: StepStats, equal, extra
) -> dict:
    """The bench's JSON: both decoders' median step times, device KV, hit rate and H2D bytes against the
    floor, each judged against its goal; ``extra`` (the mode's own figures) appended."""
    cfg = model.config
    sparse_s, keep_s = statistics.median(times["sparse"]), statistics.median(times["keep"])
    ratio = sparse_s / keep_s
    device_ratio = dev["sparse"] / dev["keep"]
    hit_rate = total.hit_rate
    layers = len(model.layers)  # the layers a decode step runs (no MTP drafts here)
    row_bytes = cfg.kv_row_width * model.dtype.itemsize
    h2d = total.h2d_bytes / steps
    floor = (1.0 - hit_rate) * cfg.index_topk * row_bytes * layers * batch
    floor_ratio = h2d / floor if floor else (1.0 if h2d == 0 else None)
    goals = {
        "step_time_ratio": GOAL_STEP_TIME_RATIO_TRACE if trace is not None else GOAL_STEP_TIME_RATIO,
        "device_kv_ratio": GOAL_DEVICE_KV_RATIO,
        "h2d_floor_ratio": GOAL_H2D_FLOOR_RATIO,
    }
    values = {"step_time_ratio": ratio, "device_kv_ratio": device_ratio, "h2d_floor_ratio": floor_ratio}
    return {
        "bench": "decode",
        "batch": batch,
        "context": context,
        "steps": steps,
        "dtype": dtype,
        "topk": cfg.index_topk,
        "topk_buffer_size": topk_buffer_size,
        "sparse_step_s": sparse_s,
        "keep_step_s": keep_s,
        "step_time_ratio": ratio,
        "device_kv_bytes": dev["sparse"],
        "device_kv_bytes_keep": dev["keep"],
        "device_kv_ratio": device_ratio,
        "hit_rate": hit_rate,
        "h2d_bytes_per_step": h2d,
        "logits_equal": equal,
        "goals_met": {name: v is not None and v <= goals[name] for name, v in values.items()},
        "trace": trace,
        "layers": layers,
        "row_bytes": row_bytes,
        "h2d_floor_bytes_per_step": floor,
        "h2d_floor_ratio": floor_ratio,
        "goals": goals,
        **extra,
    }
