"""The vLLM bench's goals (``kvoffload_bench.vllm_connectors``): each goal, whether the result meets it,
and why a figure the goals judge was not measured (a goal is never judged on a figure that was not
measured: it is not met)."""

from __future__ import annotations

from kvoffload_bench.vllm_backends import BACKENDS
from kvoffload_bench.vllm_pools import pool_goals
from kvoffload_bench.vllm_shared import shared_goals

GOAL_TTFT_RATIO = 0.3
GOAL_PD_TPOT_RATIO = 1.3
GOAL_PULL_RATIO = 0.5  # the transfer engine's pull in the stack against a memcpy under the same load
BY_BACKEND = "pull_by_backend.{}.{}"
AT_LEAST = ("requests_pulled", "ratio_to_memcpy")  # the pull_by_backend figures whose goal is a floor


def goals(out: dict) -> dict:
    """``goals``, ``goals_met`` and ``not_measured`` of the result ``out`` so far."""
    tpot = out["pd_tpot_ratio"]
    goals = {
        "ttft_ratio_prefix_hit": GOAL_TTFT_RATIO,
        "pd_tpot_ratio": GOAL_PD_TPOT_RATIO,
        "tokens_equal": True,
        "pd_requests_pulled": out["rounds"],
        "pd_requests_failed": 0,
        "pd_matrix_tokens_equal": True,
    }
    met = {
        "ttft_ratio_prefix_hit": out["ttft_ratio_prefix_hit"] <= GOAL_TTFT_RATIO,
        "pd_tpot_ratio": tpot is not None and tpot <= GOAL_PD_TPOT_RATIO,
        "tokens_equal": out["tokens_equal"],
        "pd_requests_pulled": out["pd_requests_pulled"] >= out["rounds"],
        "pd_requests_failed": out["pd_requests_failed"] == 0,
        "pd_matrix_tokens_equal": out["pd_matrix_tokens_equal"],
    }
    not_measured = {} if tpot is not None else {"pd_tpot_ratio": out["pd_tpot_ratio_not_measured"]}
    for part in (shared_goals(out), _backend_goals(out), pool_goals(out)):
        goals |= part[0]
        met |= part[1]
        not_measured |= part[2]
    goals["tokens_equal_by_backend"] = True
    met["tokens_equal_by_backend"] = out["tokens_equal_by_backend"]
    return {"goals": goals, "goals_met": met, "not_measured": not_measured}


def _backend_goals(out: dict) -> tuple[dict, dict, dict]:
    """(goals, met, not_measured) of ``pull_by_backend``: every backend's pulls (each P/D request
    pulled, none failed), the Mooncake pair's pull rate and TPOT; a backend the run left out
    (``run(backends=...)``) meets none of its goals."""
    goals: dict = {}
    for backend in BACKENDS:
        goals[BY_BACKEND.format(backend, "requests_pulled")] = out["rounds"]
        goals[BY_BACKEND.format(backend, "requests_failed")] = 0
    goals[BY_BACKEND.format("mooncake", "ratio_to_memcpy")] = GOAL_PULL_RATIO
    goals[BY_BACKEND.format("mooncake", "pd_tpot_ratio")] = GOAL_PD_TPOT_RATIO
    met, not_measured = {}, {}
    for goal in goals:
        backend, figure = goal.split(".")[1:]
        entry = out["pull_by_backend"].get(backend)
        if entry is None:
            met[goal] = False
            not_measured[goal] = f"the {backend} pair was not run (backends without {backend})"
            continue
        value = entry[figure]
        if value is None:
            met[goal] = False
            not_measured[goal] = entry.get(f"{figure}_not_measured") or (
                f"the {backend} pair's decode read some blocks another way, or timed no pull"
            )
        else:
            met[goal] = value >= goals[goal] if figure in AT_LEAST else value <= goals[goal]
    return goals, met, not_measured
