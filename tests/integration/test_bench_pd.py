"""``kvoffload bench pd`` runs end to end with small parameters and reports its fields."""

from kvoffload.bench_pd import run


def test_bench_pd_fields():
    r = run(requests=2, prompt_tokens=80, max_tokens=6, rounds=2)
    assert r["tokens_equal"] and r["rounds"] == 2 and len(r["per_round"]) == 2
    for key in ("ttft_ratio", "tpot_ratio", "pull_gbps_in_stack", "memcpy_gbps_in_stack",
                "pull_gbps_in_stack_ratio_to_memcpy", "idle_pull_ratio_to_memcpy"):
        assert r[key] > 0, key
    for rnd in r["per_round"]:
        assert rnd["pulls"] == 2 * 5  # every layer of both requests was pulled once, in every round
        assert rnd["memcpy_copies"] >= 1
        assert abs(rnd["pull_gbps_in_stack_ratio_to_memcpy"] - rnd["pull_gbps_in_stack"] / rnd["memcpy_gbps_in_stack"]) < 1e-9
    assert r["pulls"] == 2 * 2 * 5 and r["pull_bytes_per_pull"] == r["memcpy_bytes"]  # the reference copies one pull's bytes
    assert set(r["goals_met"]) == set(r["goals"]) == {"tpot_ratio", "pull_gbps_in_stack_ratio_to_memcpy"}
    assert r["goals_met"]["pull_gbps_in_stack_ratio_to_memcpy"] == (r["pull_gbps_in_stack_ratio_to_memcpy"] >= 0.5)
