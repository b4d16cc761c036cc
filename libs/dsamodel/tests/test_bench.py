"""The engine benchmarks run end to end with small parameters and report their fields."""

import pytest
import structlog

from dsamodel.bench import decode, prefill, prefix


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    structlog.reset_defaults()  # the benches silence info logs process-wide


def test_prefill_bench_fields():
    r = prefill.run(prompt_tokens=256, chunk_size=64, block_size=16, reps=1, dtype="float32")
    # the default deep model: 27 decoder layers + 1 MTP = 28 cache layers, layer 0 independent, 27 on B = 3 buffers
    assert r["num_hidden_layers"] == 27 and r["num_mtp_layers"] == 1 and r["num_logical_layers"] == 28
    assert r["num_independent"] == 1 and r["independent_layers"] == [0]
    assert r["num_shared_buffers"] == 3 and r["num_buffers"] == 4 and r["layers_per_shared_buffer"] == [9, 9, 9]
    assert r["expected_device_kv_ratio"] == 4 / 28 and abs(r["device_kv_ratio"] - 4 / 28) < 1e-12
    assert r["device_kv_bytes"] * 7 == r["device_kv_bytes_no_reuse"]
    assert r["logits_equal"] is True and r["goals_met"]["device_kv_ratio"] is True
    assert r["reuse_s"] > 0 and r["no_reuse_s"] > 0 and r["time_ratio"] == r["reuse_s"] / r["no_reuse_s"]
    assert set(r["goals_met"]) == {"time_ratio", "device_kv_ratio"}
    assert r["goals_met"]["time_ratio"] == (r["time_ratio"] <= 1.10)
    # a shallower model through the same parameters: 7 + 1 layers, I = 1, B = 3 -> 4/8
    r = prefill.run(prompt_tokens=64, chunk_size=32, block_size=16, num_hidden_layers=7, reps=1, dtype="float32")
    assert r["num_logical_layers"] == 8 and r["layers_per_shared_buffer"] == [3, 2, 2]
    assert r["device_kv_ratio"] == r["expected_device_kv_ratio"] == 0.5 and r["logits_equal"] is True


def test_prefix_bench_fields():
    r = prefix.run(prefix_tokens=256, suffix_tokens=32, chunk_size=128, block_size=16, reps=1, dtype="float32")
    assert r["first_computed_tokens"] == 288 and r["second_computed_tokens"] == 32
    assert r["ttft_ratio"] > 0


def test_decode_bench_fields():
    r = decode.run(batch=2, context=512, steps=4, topk_buffer_size=128, block_size=16, dtype="float32")
    assert r["logits_equal"]
    assert 0 < r["device_kv_ratio"] < 1 and 0 <= r["hit_rate"] <= 1 and r["h2d_bytes_per_step"] > 0
