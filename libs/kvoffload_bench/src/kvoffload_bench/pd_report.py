"""The P/D bench's report (``kvoffload_bench.pd``): each round's TTFT / TPOT and pull figures, their
medians over the rounds (None when a round did not measure one), the TP 2 block, and the goals with
what was not measured (the module docstring of ``kvoffload_bench.pd`` defines every figure)."""

from __future__ import annotations

import statistics

GOAL_TPOT_RATIO = 1.3
GOAL_PULL_RATIO = 0.5
MOONCAKE_GOAL = "pull_by_backend.mooncake.ratio_to_memcpy"
ACROSS_GOAL = "pull_across_namespaces.mooncake_to_grpc_stream"
GOAL_ACROSS_RATIO = 2.0  # Mooncake Transfer Engine at least twice the gRPC stream across a network stack
BY_RANK = "bytes_read_prefill_tp_rank_"  # the decode's Stats: bytes pulled out of prefill TP rank <r>


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den; None (not measured) when either is None or den is 0."""
    return num / den if num is not None and den else None


def _measured_median(values: list[float | None]) -> float | None:
    """The median of ``values``; None (not measured) when any of them is."""
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if len(measured) == len(values) else None


def round_figures(
    pd: list[tuple[list[int], float, float | None]],
    single_ttft: list[float],
    single_tpot: list[float | None],
    before: dict,
    after: dict,
) -> dict:
    """One pair's TTFT / TPOT figures (``pd``: ``_stream_timed`` per request) and the decode's pulls
    (its stats ``before`` and ``after`` the P/D round)."""
    pd_ttft, s_ttft = statistics.median(r[1] for r in pd), statistics.median(single_ttft)
    pd_tpot, s_tpot = _measured_median([r[2] for r in pd]), _measured_median(single_tpot)
    return {
        "pd_ttft_s": pd_ttft,
        "single_ttft_s": s_ttft,
        "ttft_ratio": pd_ttft / s_ttft,
        "pd_tpot_s": pd_tpot,
        "single_tpot_s": s_tpot,
        "tpot_ratio": _ratio(pd_tpot, s_tpot),
        "pulls": int(after["read_done"] - before["read_done"]),
        "pull_bytes": int(after["bytes_read"] - before["bytes_read"]),
        # per prefill TP rank: its shares (a rank that had pulled nothing before had no counter)
        "pull_bytes_by_prefill_tp_rank": {
            k.removeprefix(BY_RANK): int(v - before.get(k, 0))
            for k, v in sorted(after.items())
            if k.startswith(BY_RANK)
        },
    }


def pull_figures(before: dict, after: dict, memcpy_gbps: float, copies: int) -> dict:
    """The decode's pull rate over a P/D round against the memcpy sampled under the same load;
    None (not measured) when the decode timed no pull of any byte or the sampler no copy."""
    nbytes = after["bytes_read"] - before["bytes_read"]
    seconds = (after["read_ms_total"] - before["read_ms_total"]) / 1000
    pull_gbps = nbytes / seconds / 1e9 if nbytes > 0 and seconds > 0 else None
    return {
        "pull_gbps_in_stack": pull_gbps,
        "memcpy_gbps_in_stack": memcpy_gbps,
        "memcpy_copies": copies,
        "pull_gbps_in_stack_ratio_to_memcpy": _ratio(pull_gbps, memcpy_gbps),
    }


def median(per_round: list[dict], key: str) -> float | None:
    """The median of ``key`` over the rounds; None (not measured) when a round did not measure it."""
    return _measured_median([r[key] for r in per_round])


# goal -> why its figure can be None (not measured)
NOT_MEASURED = {
    "tpot_ratio": "a request's tokens after the first half of its stream arrived at once (one chunk, or "
    "fewer than two tokens), so no gap between tokens was timed",
    "pull_gbps_in_stack_ratio_to_memcpy": "the decode timed no pull of any byte (its bytes_read / read_ms_total "
    "did not grow), or the memcpy sampler timed no copy",
}


def _not_measured(per_round: list[dict], key: str) -> str:
    rounds = [i for i, r in enumerate(per_round) if r[key] is None]
    return f"not measured in round(s) {rounds}: {NOT_MEASURED[key]}"


def goals(out: dict, per_round: list[dict]) -> dict:
    """``goals``, ``goals_met`` and ``not_measured`` of the result ``out`` so far (a goal whose figure
    is None was not measured: not met, and ``not_measured`` says why)."""
    tpot, pull = out["tpot_ratio"], out["pull_gbps_in_stack_ratio_to_memcpy"]
    goals = {"tpot_ratio": GOAL_TPOT_RATIO, "pull_gbps_in_stack_ratio_to_memcpy": GOAL_PULL_RATIO, "tokens_equal": True}
    met = {
        "tpot_ratio": tpot is not None and tpot <= GOAL_TPOT_RATIO,
        "pull_gbps_in_stack_ratio_to_memcpy": pull is not None and pull >= GOAL_PULL_RATIO,
        "tokens_equal": out["tokens_equal"],
    }
    if "tp_2_1" in out:
        goals["tp_2_1_tokens_equal"], met["tp_2_1_tokens_equal"] = True, out["tp_2_1"]["tokens_equal"]
    not_measured = {k: _not_measured(per_round, k) for k in NOT_MEASURED if out[k] is None}
    if "pull_by_backend" in out:  # the transfer engine's pull, one host
        mooncake = out["pull_by_backend"]["mooncake"]["ratio_to_memcpy"]
        goals[MOONCAKE_GOAL], met[MOONCAKE_GOAL] = GOAL_PULL_RATIO, mooncake is not None and mooncake >= GOAL_PULL_RATIO
        goals["tokens_equal_by_backend"], met["tokens_equal_by_backend"] = True, out["tokens_equal_by_backend"]
        if mooncake is None:
            not_measured[MOONCAKE_GOAL] = "the mooncake stack's decode read some rows another way, or timed no pull"
    if "pull_across_namespaces" in out:  # the paths across hosts
        ratio = out["pull_across_namespaces"]["mooncake_to_grpc_stream"]
        goals[ACROSS_GOAL], met[ACROSS_GOAL] = GOAL_ACROSS_RATIO, ratio is not None and ratio >= GOAL_ACROSS_RATIO
        goals["tokens_equal_across_namespaces"] = True
        met["tokens_equal_across_namespaces"] = out["tokens_equal_across_namespaces"]
        if ratio is None:
            not_measured[ACROSS_GOAL] = "a split stack's decode read some rows another way, or timed no pull"
    return {"goals": goals, "goals_met": met, "not_measured": not_measured}


def tp_figures(tp_rounds: list[dict], tp_equal: bool) -> dict:
    """``tp_2_1``: the rounds with a TP 2 prefill, their medians, pulls and each prefill rank's bytes."""
    return {
        "prefill_tp": 2,
        "decode_tp": 1,
        "dtype": "float32",
        **{
            k: median(tp_rounds, k)
            for k in ("pd_ttft_s", "single_ttft_s", "ttft_ratio", "pd_tpot_s", "single_tpot_s", "tpot_ratio")
        },
        "pulls": sum(r["pulls"] for r in tp_rounds),
        "pull_bytes": sum(r["pull_bytes"] for r in tp_rounds),
        "pull_bytes_by_prefill_tp_rank": {
            rank: sum(r["pull_bytes_by_prefill_tp_rank"][rank] for r in tp_rounds)
            for rank in tp_rounds[0]["pull_bytes_by_prefill_tp_rank"]
        },
        "tokens_equal": tp_equal,
        "per_round": tp_rounds,
    }


def figures(
    per_round: list[dict],
    tokens_equal: bool,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    rounds: int,
    memcpy_bytes: int,
) -> dict:
    """The result's figures over the one-rank rounds: the sizes, the medians, the pulls and the rounds."""
    pulls = sum(r["pulls"] for r in per_round)
    pull_bytes = sum(r["pull_bytes"] for r in per_round)
    return {
        "bench": "pd",
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "rounds": rounds,
        **{
            k: median(per_round, k)
            for k in ("pd_ttft_s", "single_ttft_s", "ttft_ratio", "pd_tpot_s", "single_tpot_s", "tpot_ratio")
        },
        "pulls": pulls,
        "pull_bytes": pull_bytes,
        "pull_bytes_per_pull": pull_bytes // pulls if pulls else None,
        "memcpy_bytes": memcpy_bytes,
        **{
            k: median(per_round, k)
            for k in ("pull_gbps_in_stack", "memcpy_gbps_in_stack", "pull_gbps_in_stack_ratio_to_memcpy")
        },
        "tokens_equal": tokens_equal,
        "per_round": per_round,
    }
