"""``kvoffload bench pd`` runs end to end with small parameters and reports its fields."""

from kvoffload.bench_pd import run


def test_bench_pd_fields():
    r = run(requests=2, prompt_tokens=80, max_tokens=6)
    assert r["tokens_equal"]
    for key in ("ttft_ratio", "tpot_ratio", "pull_gbps_ratio_to_memcpy", "pull_gbps_in_stack"):
        assert r[key] > 0, key
    assert r["pulls"] == 2 * 5  # every layer of both requests was pulled once
    assert set(r["goals_met"]) == {"tpot_ratio", "pull_gbps_ratio_to_memcpy"}
