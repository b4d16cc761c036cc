"""The decode bench's report (``kvoffload_bench.decode``): its goals, the sparse decoder's summed
``StepStats``, the device KV read from the counting allocator, and the JSON both modes (prompts,
trace) return: step-time, device-KV and H2D-floor ratios and the logits' equality, each judged
against its goal.

A figure that could not be measured is never read as met: its goal is not met and ``not_measured``
says why. The H2D floor is measured only when the sparse decoder's hot cache saw every selection
(hits + misses = steps x k x layers x batch: no stats recorded, or fewer selections than the floor
assumes, leave it unmeasured); the device-KV ratio only when the allocator counted bytes under each
tag the KV is allocated with (``SPARSE_TAGS``, ``KEEP_TAGS``: a renamed or untracked buffer would
otherwise count as 0 bytes).
"""

from __future__ import annotations

import statistics

from kvoffload_engine.decode import StepStats

GOAL_STEP_TIME_RATIO = 1.25
GOAL_STEP_TIME_RATIO_TRACE = 1.10
GOAL_DEVICE_KV_RATIO = 0.2
GOAL_H2D_FLOOR_RATIO = 1.02
# below the floor (beyond rounding): fewer bytes copied than the misses need, some miss was never loaded
H2D_FLOOR_MIN = 1.0 - 1e-9
SPARSE_TAGS = ("decode.indexer", "decode.hot")  # the sparse decoder's device KV: indexer cache + hot buffers
KEEP_TAGS = ("decode.indexer", "decode.full_kv")  # keep_device_kv_cache: indexer cache + the whole KV


def add_stats(total: StepStats, st: StepStats) -> None:
    """``st``'s counters added into ``total``."""
    total.hits += st.hits
    total.misses += st.misses
    total.h2d_bytes += st.h2d_bytes
    total.prefetched += st.prefetched
    total.prefetch_hits += st.prefetch_hits
    total.load_s += st.load_s


def device_kv(allocator) -> dict[str, int]:
    """Device bytes of the decode's KV by allocator tag (its allocations tagged ``decode.*``)."""
    return {k: v for k, v in allocator.stats().current_by_tag.items() if k.startswith("decode.")}


def report(
    *,
    trace,
    model,
    batch,
    context,
    steps,
    dtype,
    topk_buffer_size,
    times,
    dev: dict[str, dict[str, int]],
    total: StepStats,
    equal: bool,
    extra: dict,
    prefetch_equal: bool | None = None,
) -> dict:
    """The bench's JSON: both decoders' median step times, device KV (``dev``: tag -> bytes of each
    decoder, ``device_kv``), hit rate and H2D bytes against the floor and the logits' equality
    (``equal``: sparse == keep at every step; ``prefetch_equal``, trace mode: sparse == the prefetch
    decoder), each judged against its goal; ``extra`` (the mode's own figures) appended."""
    cfg = model.config
    sparse_s, keep_s = statistics.median(times["sparse"]), statistics.median(times["keep"])
    layers = len(model.layers)  # the layers a decode step runs (no MTP drafts here)
    row_bytes = cfg.kv_row_width * model.dtype.itemsize
    h2d, why_h2d = _h2d_floor(total, steps=steps, k=cfg.index_topk, layers=layers, batch=batch, row_bytes=row_bytes)
    device_ratio, why_dev = _device_kv_ratio(dev)
    all_equal = bool(equal) and prefetch_equal is not False
    goals, met = _goals(trace, sparse_s / keep_s, device_ratio, h2d["h2d_floor_ratio"], all_equal)
    not_measured = {name: why for name, why in (("h2d_floor_ratio", why_h2d), ("device_kv_ratio", why_dev)) if why}
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
        "step_time_ratio": sparse_s / keep_s,
        "device_kv_bytes": sum(dev["sparse"].values()),
        "device_kv_bytes_keep": sum(dev["keep"].values()),
        "device_kv_bytes_by_tag": {name: dict(dev[name]) for name in ("sparse", "keep")},
        "device_kv_ratio": device_ratio,
        "logits_equal": bool(equal),
        "goals_met": met,
        "not_measured": not_measured,
        "trace": trace,
        "layers": layers,
        "row_bytes": row_bytes,
        **h2d,
        "goals": goals,
        **extra,
    }


def _goals(
    trace, step_ratio: float, device_ratio: float | None, floor_ratio: float | None, all_equal: bool
) -> tuple[dict, dict[str, bool]]:
    """``goals`` (the thresholds) and ``goals_met``: a ratio that is None (not measured) is not met, nor
    an H2D floor ratio below 1 (fewer bytes copied than the misses need)."""
    goals = {
        "step_time_ratio": GOAL_STEP_TIME_RATIO_TRACE if trace is not None else GOAL_STEP_TIME_RATIO,
        "device_kv_ratio": GOAL_DEVICE_KV_RATIO,
        "h2d_floor_ratio": GOAL_H2D_FLOOR_RATIO,
        "logits_equal": True,
    }
    met = {
        "step_time_ratio": step_ratio <= goals["step_time_ratio"],
        "device_kv_ratio": device_ratio is not None and device_ratio <= GOAL_DEVICE_KV_RATIO,
        "h2d_floor_ratio": floor_ratio is not None and H2D_FLOOR_MIN <= floor_ratio <= GOAL_H2D_FLOOR_RATIO,
        "logits_equal": all_equal,
    }
    return goals, met


def _h2d_floor(total: StepStats, *, steps: int, k: int, layers: int, batch: int, row_bytes: int) -> tuple[dict, str]:
    """The hit rate, H2D bytes per step (counted where the copies happen, ``StepStats.h2d_bytes``),
    the floor and their ratio; every figure None with the reason when the hot cache did not see
    every selection the floor is computed from ("" when measured)."""
    seen, want = total.hits + total.misses, steps * k * layers * batch
    h2d = total.h2d_bytes / steps
    if seen != want:
        why = (
            f"the hot cache counted {total.hits} hits + {total.misses} misses = {seen} selections, not steps x k "
            f"x layers x batch = {steps} x {k} x {layers} x {batch} = {want}: no hit rate to derive a floor from"
        )
        none = {"hit_rate": None, "h2d_floor_bytes_per_step": None, "h2d_floor_ratio": None}
        return {**none, "h2d_bytes_per_step": h2d, "selections": seen, "expected_selections": want}, why
    hit_rate = total.hits / seen
    floor = (1.0 - hit_rate) * k * row_bytes * layers * batch
    ratio = h2d / floor if floor else (1.0 if h2d == 0 else None)
    figures = {
        "hit_rate": hit_rate,
        "h2d_bytes_per_step": h2d,
        "h2d_floor_bytes_per_step": floor,
        "h2d_floor_ratio": ratio,
        "selections": seen,
        "expected_selections": want,
    }
    return figures, "" if ratio is not None else f"no miss, yet {h2d} H2D bytes per step were copied"


def _device_kv_ratio(dev: dict[str, dict[str, int]]) -> tuple[float | None, str]:
    """Sparse device KV bytes / keep's, or None and why when a tag the KV is allocated with counted
    no bytes on its side ("" when measured)."""
    missing = [
        f"{name}: {tag}"
        for name, tags in (("sparse", SPARSE_TAGS), ("keep", KEEP_TAGS))
        for tag in tags
        if dev[name].get(tag, 0) <= 0
    ]
    if missing:
        return None, "the counting allocator holds no bytes under " + ", ".join(missing)
    return sum(dev["sparse"].values()) / sum(dev["keep"].values()), ""
