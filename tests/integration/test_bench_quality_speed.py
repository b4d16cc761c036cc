"""``kvoffload bench quality``'s speed half on a small run (one 256-token context, 8 tokens, one
round): the sparse stack, the dense stack and plain vLLM all answered with stream timing, the ratios
are the medians' quotients, and the sparse decode's device KV per request is below the dense
decode's and within its bound (hot buffer and indexer rows over the full KV)."""

from __future__ import annotations

import json

import pytest

from kvoffload_bench.quality_speed import SYSTEMS, measure_speed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_measure_speed_small():
    r = measure_speed(contexts=(256,), new_tokens=8, rounds=1, log=lambda line: None)
    json.dumps(r)
    assert r["contexts"] == [256] and r["new_tokens"] == 8 and r["rounds"] == 1
    assert r["not_measured"] == {}, r["not_measured"]
    tpot = r["tpot_s"]["256"]
    assert set(tpot) == set(SYSTEMS) and all(t > 0 for t in tpot.values()), tpot
    assert r["tpot_ratio_to_vllm"]["256"] == pytest.approx(tpot["sparse"] / tpot["vllm"])
    assert r["tpot_ratio_sparse_to_dense"]["256"] == pytest.approx(tpot["sparse"] / tpot["dense"])
    kv = r["device_kv_bytes"]
    assert 0 < kv["sparse"] < kv["dense"], kv
    assert r["device_kv_ratio"] == pytest.approx(kv["sparse"] / kv["dense"])
    assert r["device_kv_ratio"] <= r["device_kv_ratio_bound"] * 1.01 and r["device_kv_ratio"] < 1, r
    assert r["threads"] >= 1
