"""``kvoffload bench vllm`` on a small model: the pool's hit covers every full block of the prompt
but the one holding its last token, the hit's tokens equal the miss's, the JSON carries every field
and says that the P/D figures are not measured (goal not met) instead of leaving them out."""

from __future__ import annotations

import json

from vllm_support import tiny_llama_dir

from kvoffload.bench_vllm import run


def test_bench_vllm_small(tmp_path):
    r = run(model=str(tiny_llama_dir(tmp_path / "tiny")), prefix_tokens=1024, rounds=1, max_tokens=4, progress=False)
    json.dumps(r)
    assert r["tokens_equal"] is True and r["goals_met"]["tokens_equal"] is True
    assert r["hit_tokens_per_request"] == 1024  # 1064 prompt tokens: 8 full blocks of 128
    assert r["per_round"][0]["miss_hit_tokens"] == 0  # the first send found nothing in the pool
    assert 0 < r["bytes_loaded_per_request"] < r["prompt_kv_bytes"]
    assert 0 < r["ttft_ratio_prefix_hit"] and r["goals_met"]["ttft_ratio_prefix_hit"] == (r["ttft_ratio_prefix_hit"] <= 0.3)
    assert r["pd_tpot_ratio"] is None and "not implemented" in r["pd"] and r["goals_met"]["pd_tpot_ratio"] is False
