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
    assert r["logits_equal"] and r["device_kv_ratio"] == r["expected_device_kv_ratio"] == 0.8
    assert r["time_ratio"] > 0 and set(r["goals_met"]) == {"time_ratio", "device_kv_ratio"}


def test_prefix_bench_fields():
    r = prefix.run(prefix_tokens=256, suffix_tokens=32, chunk_size=128, block_size=16, reps=1, dtype="float32")
    assert r["first_computed_tokens"] == 288 and r["second_computed_tokens"] == 32
    assert r["ttft_ratio"] > 0


def test_decode_bench_fields():
    r = decode.run(batch=2, context=512, steps=4, topk_buffer_size=128, block_size=16, dtype="float32")
    assert r["logits_equal"]
    assert 0 < r["device_kv_ratio"] < 1 and 0 <= r["hit_rate"] <= 1 and r["h2d_bytes_per_step"] > 0
