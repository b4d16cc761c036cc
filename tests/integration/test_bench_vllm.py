"""``kvoffload bench vllm`` on a small model: the pool's hit covers every full block of the prompt
but the one holding its last token, the hit's tokens equal the miss's; P/D through the proxy (the
pair started beside the plain server, the rounds taking turns) gives the plain server's tokens (the
equality matrix's completions, streams, chats and burst too), the decode pulled the prompt's blocks
(no more, and no pull failed), and the JSON carries every field, the P/D ratios and the goal's
verdict included (a TPOT ratio only where both sides timed TPOT the same way); the pull and TPOT of
the gRPC stream's pair are measured, every read its own; the prefill's shared buffers are what the
bench configured for the model's layers, and what it logged. The bench's Mooncake pair runs the same code on another
backend (its figures and goals: ``libs/kvoffload_bench/tests/test_vllm_connectors_goals.py``; vLLM
P/D on Mooncake Transfer Engine: ``test_vllm_pd.py``, ``test_vllm_hybrid.py``), so it is left out
here (two vLLM servers fewer), and so is its store server on Mooncake Store (its figure's verdict:
``test_vllm_connectors_goals.py``; the store on Mooncake Store: ``test_vllm_mooncake_store.py``):
the embedded pool's store server gives ``ttft_ratio_prefix_hit_by_backend.kvoffload``."""

from __future__ import annotations

import json

import pytest
from vllm_support import tiny_llama_dir

from kvoffload_bench.vllm_connectors import run
from kvoffload_testing.vllm_stack import split_cores

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_bench_vllm_small(tmp_path):
    r = run(
        model=str(tiny_llama_dir(tmp_path / "tiny", num_layers=6)),
        prefix_tokens=1024,
        rounds=1,
        max_tokens=4,
        pd_prompt_tokens=300,
        pd_max_tokens=8,
        shared_prompt_tokens=1000,
        pd_matrix_tokens=(127,),  # the matrix's other lengths: test_vllm_pd.py, and the bench's own run
        backends=("grpc_stream",),
        shared_chunked=False,  # two servers more: the bench's own run (its verdict: test_vllm_connectors_goals.py)
        pools=("kvoffload",),  # the Mooncake store server: one more, the bench's own run
        progress=False,
    )
    json.dumps(r)
    assert r["tokens_equal"] is True and r["goals_met"]["tokens_equal"] is True
    assert r["hit_tokens_per_request"] == 1024  # 1064 prompt tokens: 8 full blocks of 128
    assert r["per_round"][0]["miss_hit_tokens"] == 0  # the first send found nothing in the pool
    assert 0 < r["bytes_loaded_per_request"] < r["prompt_kv_bytes"]
    assert r["ttft_ratio_prefix_hit_by_backend"] == {"kvoffload": r["ttft_ratio_prefix_hit"]}
    assert r["goals_met"]["ttft_ratio_prefix_hit_by_backend.kvoffload"] == (r["ttft_ratio_prefix_hit"] <= 0.3)
    assert "not run" in r["not_measured"]["ttft_ratio_prefix_hit_by_backend.mooncake"]
    assert 0 < r["ttft_ratio_prefix_hit"] and r["goals_met"]["ttft_ratio_prefix_hit"] == (
        r["ttft_ratio_prefix_hit"] <= 0.3
    )
    # P/D against the plain server
    assert isinstance(r["pd_ttft_ratio"], float) and r["pd_ttft_ratio"] > 0, r
    assert r["pd_tokens_equal"] is True and r["pd_per_round"][0]["tokens_equal"] is True
    sources = {r["pd_per_round"][0][f"{side}_tpot_source"] for side in ("plain", "pd")}
    assert sources <= {"stream", "server"}, sources
    if len(sources) == 1:  # both sides timed the same way: a ratio
        assert isinstance(r["pd_tpot_ratio"], float) and r["pd_tpot_ratio"] > 0, r
        assert r["goals_met"]["pd_tpot_ratio"] == (r["pd_tpot_ratio"] <= 1.3)
    else:  # a client stream against a server's own latency: not measured, not met
        assert r["pd_tpot_ratio"] is None and r["goals_met"]["pd_tpot_ratio"] is False, r
        assert "different sources" in r["not_measured"]["pd_tpot_ratio"], r["not_measured"]
    assert r["pd_requests_pulled"] == 1 and r["pd_requests_failed"] == 0, r
    # the equality matrix: every case through the proxy answered as the plain server did
    assert r["pd_matrix_mismatches"] == [] and r["goals_met"]["pd_matrix_tokens_equal"] is True, r
    assert {"completion-127", "stream-127", "chat", "chat-stream", "burst-7"} <= set(r["pd_matrix_cases"])
    # 300 tokens: 3 blocks of 128, K and V of 6 layers, 2 KV heads of 32, fp32
    assert r["pd_prompt_kv_bytes"] == 3 * 128 * 2 * 6 * 2 * 32 * 4
    # shared layer buffers on the prefill: 6 layers on 4 buffers ([0], [1, 4], [2, 5], [3]), same KV budget;
    # configured (layer 0 apart, 3 shared buffers, the model's 6 layers) and logged alike
    assert (r["prefill_buffers"], r["prefill_layers"]) == (4, 6)
    assert (r["prefill_buffers_logged"], r["prefill_layers_logged"]) == (4, 6)
    assert r["goals_met"]["prefill_buffers_logged"] is True
    assert r["prefill_capacity_ratio"] == pytest.approx(6 / 4, rel=0.01), r
    assert r["goals_met"]["prefill_capacity_ratio"] and r["goals_met"]["prefill_kv_bytes_ratio"], r
    assert r["shared_tokens_equal"] is True and r["goals_met"]["shared_tokens_equal"] is True
    for key in ("prefill_time_ratio_shared", "ttft_ratio_prefix_hit_shared"):
        assert isinstance(r[key], float) and r[key] > 0, (key, r)
    assert r["prefill_time_ratio_shared_chunk512"] is None and "prefill_time_ratio_shared_chunk512" in r["not_measured"]
    assert 0 < r["pd_bytes_pulled_per_request"] <= r["pd_prompt_kv_bytes"], r
    assert r["goals"]["pd_tpot_ratio"] == 1.3
    _check_pull_by_backend(r)  # the gRPC stream's pair measured and checked; the Mooncake pair not run
    halves = split_cores()
    if halves:
        assert r["pd_cores"] == {"plain": halves[1], "prefill": halves[0], "decode": halves[1]}


def _check_pull_by_backend(r: dict) -> None:
    """The pull of the gRPC stream's pair, measured and checked; the Mooncake pair was not run."""
    by = r["pull_by_backend"]
    assert set(by) == {"grpc_stream"} and r["tokens_equal_by_backend"] is True, by
    path = by["grpc_stream"]
    assert path["path_checked"] and path["reads"] >= 6 and path["tokens_equal"], path  # every layer once
    assert path["gbps_in_stack"] > 0 and path["memcpy_gbps"] > 0, path
    assert abs(path["ratio_to_memcpy"] - path["gbps_in_stack"] / path["memcpy_gbps"]) < 1e-9, path
    assert path["pd_tpot_ratio"] == r["pd_tpot_ratio"]  # the pd_* figures are the gRPC pair's
    assert (path["requests_pulled"], path["requests_failed"]) == (1, 0), path
    assert r["goals_met"]["pull_by_backend.grpc_stream.requests_pulled"] is True
    assert r["goals_met"]["pull_by_backend.grpc_stream.requests_failed"] is True
    assert r["goals_met"]["pull_by_backend.mooncake.requests_pulled"] is False  # not run
    assert r["goals_met"]["pull_by_backend.mooncake.ratio_to_memcpy"] is False
    assert "not run" in r["not_measured"]["pull_by_backend.mooncake.ratio_to_memcpy"]
