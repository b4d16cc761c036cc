"""``kvoffload bench vllm``'s store part on each pool backend (``kvoffload_bench.vllm_pools``), driven
end to end on fake servers (``vllm_bench_fakes``: no vLLM starts, no master): a store server per
backend, each with a prompt of its own, each judged against its own goal
(``ttft_ratio_prefix_hit_by_backend.<kvoffload|mooncake>`` <= 0.3); a backend left out meets none."""

from __future__ import annotations

import pytest
from vllm_bench_fakes import EVENTS, ROUNDS, fake_servers, run_bench


@pytest.fixture
def servers(tmp_path, monkeypatch):
    return fake_servers(tmp_path, monkeypatch)


def test_the_prefix_hit_is_measured_on_each_pool_backend_each_against_its_goal(servers):
    """The embedded pool's rounds are the top-level figures; both store servers stop before the P/D
    pairs start."""
    _, model = servers
    r = run_bench(model)
    assert r["ttft_ratio_prefix_hit_by_backend"] == pytest.approx({"kvoffload": 0.1, "mooncake": 0.1})
    assert r["ttft_ratio_prefix_hit"] == r["ttft_ratio_prefix_hit_by_backend"]["kvoffload"]
    assert r["per_round"] == r["prefix_hit_by_backend"]["kvoffload"]["per_round"]
    for pool in ("kvoffload", "mooncake"):
        assert r["goals"][f"ttft_ratio_prefix_hit_by_backend.{pool}"] == 0.3
        assert r["goals_met"][f"ttft_ratio_prefix_hit_by_backend.{pool}"] is True
        entry = r["prefix_hit_by_backend"][pool]
        assert entry["tokens_equal"] and entry["hit_tokens_per_request"] == 256 and len(entry["per_round"]) == ROUNDS
    for store in ("vllm", "vllm-mooncake"):
        assert EVENTS.index(("stop", store)) < EVENTS.index(("start", "grpc_stream-prefill")), EVENTS


def test_a_backend_whose_hits_are_slow_fails_its_own_goal_only(servers):
    knobs, model = servers
    knobs["slow_hit"]["vllm-mooncake.log"] = 4.0  # its hits take 0.4 of a miss
    r = run_bench(model)
    assert r["ttft_ratio_prefix_hit_by_backend"]["mooncake"] == pytest.approx(0.4)
    assert r["goals_met"]["ttft_ratio_prefix_hit_by_backend.mooncake"] is False
    assert r["goals_met"]["ttft_ratio_prefix_hit_by_backend.kvoffload"] is True


def test_a_run_without_the_mooncake_store_meets_no_mooncake_goal_and_says_why(servers):
    _, model = servers
    r = run_bench(model, pools=("kvoffload",))
    assert set(r["prefix_hit_by_backend"]) == {"kvoffload"} and ("start", "vllm-mooncake") not in EVENTS
    assert r["goals_met"]["ttft_ratio_prefix_hit_by_backend.mooncake"] is False
    assert "not run" in r["not_measured"]["ttft_ratio_prefix_hit_by_backend.mooncake"]
    assert r["goals_met"]["ttft_ratio_prefix_hit_by_backend.kvoffload"] is True
    with pytest.raises(ValueError, match="pools: expected 'kvoffload' first"):
        run_bench(model, pools=("mooncake",))
