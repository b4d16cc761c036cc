"""``kvoffload bench load``'s figures and verdict: one client count's rounds summarised (``level``),
and the whole run's result against its goals (``result``).

Goals, each in ``goals`` and judged in ``goals_met``:

- ``failed``: 0 failed requests over every client count's rounds;
- ``throughput_ratio``: the stack's output tokens/s >= ``GOAL_THROUGHPUT_RATIO`` x the single-process
  engine's, at every client count (the worst one);
- ``tokens_equal``: every stack answer equals the engine's greedy tokens (I3);
- the burst (``kvoffload_bench.load_burst``): ``burst_timed_out`` 0 (no request left without a byte),
  ``burst_failed`` 0 (no answer but tokens or a 429) and ``burst_ok`` >= 1 (answered: a burst where
  every request got a 5xx would otherwise meet the two before);
- the polite burst (``kvoffload_bench.load_polite``): ``burst_polite_retries_per_request`` <=
  ``GOAL_RETRIES_PER_REQUEST``, ``burst_polite_all_answered`` and ``burst_polite_failed`` 0. A
  polite burst of no request has no retries per request: not measured, never met.
"""

from __future__ import annotations

import statistics

from kvoffload_bench.load_polite import GOAL_RETRIES_PER_REQUEST

GOAL_THROUGHPUT_RATIO = 0.9
SUMMED = (
    "ok",
    "failed",
    "rejected_429",
    "retries",
    "prompt_tokens",
    "output_tokens",
    "single_output_tokens",
    "tokens_unequal",
)


def level(n: int, rounds: int, per_round: list[dict], decode_stats: dict[str, float]) -> dict:
    """One client count's figures over its rounds: counts summed, errors merged, tokens equal in all,
    every other figure the median; and the decode's queue counters."""
    out: dict[str, object] = {"clients": n, "rounds": rounds}
    for key in per_round[0]:
        values = [r[key] for r in per_round]
        if key in SUMMED:
            out[key] = sum(values)
        elif key == "errors":
            out[key] = sorted({e for v in values for e in v})[:5]
        elif key == "unequal_examples":
            out[key] = [e for v in values for e in v][:5]
        elif key == "tokens_equal":
            out[key] = all(values)
        else:
            out[key] = statistics.median(values)
    out |= {
        "decode_max_queued": int(decode_stats["max_queued"]),
        "decode_rejected_total": int(decode_stats["rejected"]),
    }
    if rounds > 1:
        out["per_round_throughput_ratio"] = [r["throughput_ratio"] for r in per_round]
    return out


def result(levels: list[dict], sizes: dict, burst: dict, polite: dict) -> dict:
    """The JSON-ready result: the run's ``sizes``, every level, the totals, the worst throughput ratio,
    the burst and the polite burst, against the goals (module doc)."""
    failures = sum(lv["failed"] for lv in levels)
    worst = min(lv["throughput_ratio"] for lv in levels)
    tokens_equal = all(lv["tokens_equal"] for lv in levels)
    per_request = polite["retries_per_request"]
    goals = {
        "failed": 0,
        "throughput_ratio": GOAL_THROUGHPUT_RATIO,
        "tokens_equal": True,
        "burst_timed_out": 0,
        "burst_failed": 0,
        "burst_ok": 1,
        "burst_polite_retries_per_request": GOAL_RETRIES_PER_REQUEST,
        "burst_polite_all_answered": True,
        "burst_polite_failed": 0,
    }
    met = {
        "failed": failures == 0,
        "throughput_ratio": worst >= GOAL_THROUGHPUT_RATIO,
        "tokens_equal": tokens_equal,
        "burst_timed_out": burst["timed_out"] == 0,
        "burst_failed": burst["failed"] == 0,
        "burst_ok": burst["ok"] >= 1,
        "burst_polite_retries_per_request": per_request is not None and per_request <= GOAL_RETRIES_PER_REQUEST,
        "burst_polite_all_answered": polite["requests"] > 0 and polite["ok"] == polite["requests"],
        "burst_polite_failed": polite["failed"] == 0,
    }
    out = {
        "bench": "load",
        **sizes,
        "levels": levels,
        "ok": sum(lv["ok"] for lv in levels),
        "failed": failures,
        "rejected_429": sum(lv["rejected_429"] for lv in levels),
        "throughput_ratio_min": worst,
        "tokens_equal": tokens_equal,
        "burst": burst,
        "burst_polite": polite,
        "goals": goals,
        "goals_met": met,
    }
    if per_request is None:
        out["not_measured"] = {"burst_polite_retries_per_request": "the polite burst sent no request"}
    return out
