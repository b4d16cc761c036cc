"""``kvoffload bench load`` runs end to end with small parameters and reports its fields."""

import pytest

from kvoffload_bench.load import run

pytestmark = [pytest.mark.stack, pytest.mark.slow]


def test_bench_load_fields():
    r = run(clients=(6,), max_prompt=60, max_tokens=4, rounds=1)
    assert r["bench"] == "load" and r["clients"] == [6] and len(r["levels"]) == 1
    lv = r["levels"][0]
    assert lv["ok"] == 6 and lv["failed"] == 0 and r["failed"] == 0 and r["tokens_equal"]
    for key in ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s", "single_output_tokens_per_s", "throughput_ratio"):
        assert lv[key] > 0, key
    assert lv["ttft_p50_s"] <= lv["ttft_p99_s"] and lv["output_tokens"] == lv["single_output_tokens"]
    assert lv["decode_max_queued"] >= 32  # the default queue limit: at least 4 x --max-num-seqs 8
    assert set(r["goals"]) == set(r["goals_met"]) == {"failed", "throughput_ratio", "tokens_equal"}
    assert r["goals_met"]["throughput_ratio"] == (r["throughput_ratio_min"] >= 0.9)
