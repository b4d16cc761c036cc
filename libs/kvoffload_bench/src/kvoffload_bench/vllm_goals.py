"""The vLLM bench's goals (``kvoffload_bench.vllm_connectors``): each goal, whether the result meets it,
and why a figure the goals judge was not measured (a goal is never judged on a figure that was not
measured: it is not met)."""

from __future__ import annotations

from kvoffload_bench.vllm_shared import shared_goals

GOAL_TTFT_RATIO = 0.3
GOAL_PD_TPOT_RATIO = 1.3
GOAL_PULL_RATIO = 0.5  # the transfer engine's pull in the stack against a memcpy under the same load
MOONCAKE = "pull_by_backend.mooncake."


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
    shared, shared_met = shared_goals(out)
    goals |= shared
    met |= shared_met
    not_measured = (
        {}
        if tpot is not None
        else {"pd_tpot_ratio": "the plain server's median TPOT is 0: its requests had a single output token"}
    )
    goals[MOONCAKE + "ratio_to_memcpy"] = GOAL_PULL_RATIO
    goals[MOONCAKE + "pd_tpot_ratio"] = GOAL_PD_TPOT_RATIO
    goals["tokens_equal_by_backend"] = True
    met["tokens_equal_by_backend"] = out["tokens_equal_by_backend"]
    mooncake = out["pull_by_backend"].get("mooncake")  # the transfer engine's pull and TPOT (vllm_backends)
    if mooncake is None:  # a run of the gRPC pair only (run(backends=...)): its goals are not met
        for key in ("ratio_to_memcpy", "pd_tpot_ratio"):
            met[MOONCAKE + key] = False
            not_measured[MOONCAKE + key] = "the mooncake pair was not run (backends without mooncake)"
        return {"goals": goals, "goals_met": met, "not_measured": not_measured}
    ratio = mooncake["ratio_to_memcpy"]
    met[MOONCAKE + "ratio_to_memcpy"] = ratio is not None and ratio >= GOAL_PULL_RATIO
    met[MOONCAKE + "pd_tpot_ratio"] = mooncake["pd_tpot_ratio"] <= GOAL_PD_TPOT_RATIO
    if ratio is None:
        not_measured[MOONCAKE + "ratio_to_memcpy"] = (
            "the mooncake pair's decode read some blocks another way, or timed no pull"
        )
    return {"goals": goals, "goals_met": met, "not_measured": not_measured}
