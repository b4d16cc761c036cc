"""``kvoffload bench load`` runs end to end with small parameters and reports its fields, the burst
case included: a decode of one sequence slot and a 2 s queue-wait bound, behind a prefill with a
1 s bound, given 16 requests at once (prompts up to 3,000 tokens: seconds of prefill queued)
answers each (tokens, or 429 with Retry-After) and lets none wait without a byte; both bounds
refused some. Then the polite burst: 16 fresh requests whose clients follow each Retry-After are
all answered, and the hints they were given are not one short wait for all."""

import pytest

from kvoffload_bench.load import run

pytestmark = [pytest.mark.stack, pytest.mark.slow]


def test_bench_load_fields():
    r = run(
        clients=(6,),
        max_prompt=60,
        max_tokens=4,
        rounds=1,
        decode_args=("--max-num-seqs", "1", "--max-queue-wait-s", "2"),
        prefill_args=("--max-queue-wait-s", "1"),
        burst_requests=16,
        burst_max_prompt=3000,
        burst_max_tokens=64,
        burst_client_timeout_s=30,
    )
    assert r["bench"] == "load" and r["clients"] == [6] and len(r["levels"]) == 1
    lv = r["levels"][0]
    assert lv["ok"] == 6 and lv["failed"] == 0 and r["failed"] == 0 and r["tokens_equal"]
    for key in ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s", "single_output_tokens_per_s", "throughput_ratio"):
        assert lv[key] > 0, key
    assert lv["ttft_p50_s"] <= lv["ttft_p99_s"] and lv["output_tokens"] == lv["single_output_tokens"]
    assert lv["decode_max_queued"] >= 4  # the default queue limit: at least 4 x --max-num-seqs 1
    assert (
        set(r["goals"])
        == set(r["goals_met"])
        == {
            "failed",
            "throughput_ratio",
            "tokens_equal",
            "burst_timed_out",
            "burst_failed",
            "burst_ok",
            "burst_polite_retries_per_request",
            "burst_polite_all_answered",
            "burst_polite_failed",
        }
    )
    assert r["goals"]["throughput_ratio"] == 0.9 and r["goals"]["burst_polite_retries_per_request"] == 3
    # the burst: every request answered or refused, none left waiting; the bound refused some
    b = r["burst"]
    assert (b["requests"], b["streamed"], b["client_timeout_s"]) == (16, 8, 30), b
    assert (b["max_queue_wait_s"], b["prefill_max_queue_wait_s"]) == (2.0, 1.0), b
    assert b["ok"] + b["rejected_429"] == 16 and b["timed_out"] == 0 and b["failed"] == 0, b
    assert b["ok"] >= 1 and b["rejected_429"] >= 1, b  # not all within the bounds
    prefill_refused = b["prefill_queue_timeouts"] + b["prefill_rejected_by_estimate"]
    assert prefill_refused >= 1 and b["prefill_rejected_queue_full"] == 0, b  # seconds of prompts queued
    assert prefill_refused + b["queue_timeouts"] + b["rejected_by_estimate"] <= b["rejected_429"], b
    assert b["prefill_run_4k_s"] > 0 and b["prefill_run_fixed_s"] >= 0, b
    assert all(s >= 1 for s in b["retry_after_s"]) and b["first_answer_max_s"] < 30, b
    assert b["retry_after_missing"] == 0, b
    assert r["goals_met"]["burst_timed_out"] and r["goals_met"]["burst_failed"] and r["goals_met"]["burst_ok"]
    # the polite burst: every client follows its Retry-After until answered
    p = r["burst_polite"]
    assert (p["requests"], p["streamed"], p["client_timeout_s"]) == (16, 8, 30), p
    assert p["ok"] == 16 and p["failed"] == 0 and p["timed_out"] == 0 and p["not_followed"] == 0, p
    assert p["retries"] == p["rejected_429"] >= 1 and p["retries_per_request"] == p["retries"] / 16, p
    assert p["prefill_queue_timeouts"] + p["prefill_rejected_by_estimate"] >= 1, p  # its bound refused some
    assert len(p["retry_after_s"]) >= 2, p  # told when each would be admitted, not one short wait for all
    assert r["goals_met"]["burst_polite_all_answered"] and r["goals_met"]["burst_polite_failed"], p
