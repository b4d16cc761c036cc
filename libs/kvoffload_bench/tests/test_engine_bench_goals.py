"""The engine benches cannot pass by accident: logits that differ fail ``logits_equal`` (prefill;
decode on prompts and on a trace, the prefetch decoder included), prefill's expected device ratio
comes from the config sent, not the engine's plan, and a decode figure that was not recorded (no
hot-cache stats, a KV buffer under another allocator tag) is not met and named in ``not_measured``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import structlog
import torch

import kvoffload_bench.decode as decode_mod
import kvoffload_bench.decode_trace as decode_trace
from kvcore.device import DeviceAllocator
from kvoffload_bench import decode, decode_report, prefill
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder, StepStats

BS = 16
K = 64  # the tiny preset's index_topk
PREFILL_SMALL = {"prompt_tokens": 64, "chunk_size": 32, "block_size": 16, "num_hidden_layers": 7, "reps": 1}
TRACE_SMALL = {
    "trace": "overlap90",
    "trace_params": {"k": K, "sinks": 4, "recent": 8, "heavy": 8},
    "batch": 2,
    "context": 256,
    "steps": 2,
    "block_size": BS,
    "dtype": "float32",
}


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    structlog.reset_defaults()  # the benches silence info logs process-wide


def _wrap_reuse_engine(monkeypatch, change):
    """``build.prefill_engine`` with ``change(kwargs)`` applied to the reuse engine's arguments and
    ``change(engine)`` to the engine built (``change`` returns what it was given)."""
    real = build.prefill_engine

    def wrapped(model, pool, **kw):
        reuse = kw.get("model_id") == "bench-reuse"
        return change(real(model, pool, **change(kw) if reuse else kw)) if reuse else real(model, pool, **kw)

    monkeypatch.setattr(build, "prefill_engine", wrapped)


def test_prefill_expected_device_ratio_comes_from_the_config_not_the_plan(monkeypatch):
    """An engine that quietly runs one shared buffer more than it was sent: its own plan would expect
    5/8 and be met; the config sent (N = 8, I = 1, B = 3) expects 4/8."""
    _wrap_reuse_engine(monkeypatch, lambda x: x | {"buffers": x["buffers"] + 1} if isinstance(x, dict) else x)
    r = prefill.run(**PREFILL_SMALL, dtype="float32")
    assert r["num_buffers"] == 5 and r["device_kv_ratio"] == 5 / 8  # what the engine did
    assert r["goals_met"]["device_kv_ratio"] is False  # the engine's own plan would have met it
    assert r["expected_device_kv_ratio"] == r["goals"]["device_kv_ratio"] == 0.5
    assert r["logits_equal"] is True and r["goals_met"]["logits_equal"] is True


def test_prefill_logits_that_differ_fail_logits_equal(monkeypatch):
    def wrong_logits(eng):
        if isinstance(eng, dict):
            return eng
        real_run = eng.run

        def run(req):
            res = real_run(req)
            res.logits = res.logits.clone()
            res.logits[0] += 1.0
            return res

        eng.run = run
        return eng

    _wrap_reuse_engine(monkeypatch, wrong_logits)
    r = prefill.run(**PREFILL_SMALL, dtype="float32")
    assert r["goals"]["logits_equal"] is True
    assert r["logits_equal"] is False and r["goals_met"]["logits_equal"] is False
    assert r["goals_met"]["device_kv_ratio"] is True  # the rest still judged


@pytest.mark.parametrize(
    ("n", "buffers", "independent", "expected"),
    [(28, 3, (0,), 4 / 28), (8, 3, (0,), 4 / 8), (8, 3, (0, -1), 5 / 8), (8, 3, (0, 8), 4 / 8), (4, 5, (0,), 1.0)],
)
def test_prefill_expected_ratio_from_the_inputs(n, buffers, independent, expected):
    assert prefill.expected_device_kv_ratio(n, buffers, independent) == expected


def test_decode_without_hot_cache_stats_has_no_h2d_floor(monkeypatch):
    """No stats recorded: a hit rate of 0 would give a floor ratio of 0, which met <= 1.02."""
    monkeypatch.setattr(decode_trace, "add_stats", lambda total, st: None)
    r = decode.run(**TRACE_SMALL)
    assert r["goals_met"]["h2d_floor_ratio"] is False and r["h2d_floor_ratio"] is None
    assert r["hit_rate"] is None and r["selections"] == 0 and r["expected_selections"] == 2 * K * 4 * 2
    assert "h2d_floor_ratio" in r["not_measured"] and "0 selections" in r["not_measured"]["h2d_floor_ratio"]
    assert r["device_kv_ratio"] is not None and "device_kv_ratio" not in r["not_measured"]  # still measured


def test_decode_with_a_renamed_kv_tag_has_no_device_kv_ratio(monkeypatch):
    """The hot buffers allocated under another tag: summing ``decode.*`` would count them as 0 bytes."""
    real = DeviceAllocator.zeros
    renamed = lambda self, shape, dtype, tag: real(self, shape, dtype, "hot" if tag == "decode.hot" else tag)  # noqa: E731
    monkeypatch.setattr(DeviceAllocator, "zeros", renamed)
    r = decode.run(**TRACE_SMALL)
    assert r["device_kv_ratio"] is None and r["goals_met"]["device_kv_ratio"] is False
    assert r["not_measured"]["device_kv_ratio"] == "the counting allocator holds no bytes under sparse: decode.hot"
    assert r["goals_met"]["h2d_floor_ratio"] is True and "h2d_floor_ratio" not in r["not_measured"]


def test_decode_trace_prefetch_logits_that_differ_fail_logits_equal(monkeypatch):
    real = SparseDecoder.step

    def step(self, ids, tokens):
        out = real(self, ids, tokens)
        if self.prefetcher is None:
            return out
        out = out.clone()
        out[0, 0] += 1.0
        return out

    monkeypatch.setattr(SparseDecoder, "step", step)
    r = decode.run(**TRACE_SMALL)
    assert r["logits_equal"] is True and r["prefetch"]["logits_equal"] is False  # sparse == keep still
    assert r["goals"]["logits_equal"] is True and r["goals_met"]["logits_equal"] is False


def test_decode_prompts_logits_that_differ_fail_logits_equal(monkeypatch):
    real = SparseDecoder.forward

    def forward(self, ids, tokens):
        logits, h = real(self, ids, tokens)
        if self.keep_device_kv_cache:
            return logits, h
        logits = logits.clone()
        logits[0, 0] += 1.0
        return logits, h

    monkeypatch.setattr(SparseDecoder, "forward", forward)
    r = decode_mod.run(batch=2, context=256, steps=2, topk_buffer_size=128, block_size=BS, dtype="float32")
    assert r["logits_equal"] is False and r["goals_met"]["logits_equal"] is False
    assert r["not_measured"] == {}


def _report(total: StepStats, dev=None, *, equal=True, prefetch_equal=None):
    """The report of 2 steps, batch 2, 3 layers, k 4, 32-byte rows: 48 selections expected."""
    model = SimpleNamespace(config=SimpleNamespace(index_topk=4, kv_row_width=8), layers=[0, 1, 2], dtype=torch.float32)
    dev = dev or {
        "sparse": {"decode.indexer": 100, "decode.hot": 50},
        "keep": {"decode.indexer": 100, "decode.full_kv": 900},
    }
    return decode_report.report(
        trace=None,
        model=model,
        batch=2,
        context=64,
        steps=2,
        dtype="float32",
        topk_buffer_size=8,
        times={"sparse": [1.0], "keep": [1.0]},
        dev=dev,
        total=total,
        equal=equal,
        extra={},
        prefetch_equal=prefetch_equal,
    )


def test_decode_report_judges_what_was_recorded():
    r = _report(StepStats(hits=36, misses=12, h2d_bytes=12 * 32))
    assert r["goals"] == {
        "step_time_ratio": 1.25,
        "device_kv_ratio": 0.2,
        "h2d_floor_ratio": 1.02,
        "logits_equal": True,
    }
    assert r["hit_rate"] == 0.75 and r["h2d_floor_bytes_per_step"] == 6 * 32 and r["h2d_floor_ratio"] == 1.0
    assert r["device_kv_ratio"] == 150 / 1000 and r["not_measured"] == {}
    assert r["goals_met"] == {
        "step_time_ratio": True,
        "device_kv_ratio": True,
        "h2d_floor_ratio": True,
        "logits_equal": True,
    }


@pytest.mark.parametrize(
    ("total", "why"),
    [
        (StepStats(), "0 selections"),  # nothing recorded
        (StepStats(hits=30, misses=12, h2d_bytes=12 * 32), "42 selections"),  # some selections not seen
    ],
)
def test_decode_report_without_every_selection_has_no_floor(total, why):
    r = _report(total)
    assert r["h2d_floor_ratio"] is None and r["goals_met"]["h2d_floor_ratio"] is False
    assert why in r["not_measured"]["h2d_floor_ratio"]


def test_decode_report_fewer_bytes_than_the_misses_need_is_not_met():
    r = _report(StepStats(hits=36, misses=12, h2d_bytes=11 * 32))  # a miss never copied
    assert r["h2d_floor_ratio"] == 11 / 12 and r["goals_met"]["h2d_floor_ratio"] is False
    r = _report(StepStats(hits=36, misses=12, h2d_bytes=13 * 32))  # 1.083 x the floor
    assert r["goals_met"]["h2d_floor_ratio"] is False


@pytest.mark.parametrize(
    ("sparse", "keep", "missing"),
    [
        (
            {"decode.indexer": 100, "decode.hot_rows": 50},
            {"decode.indexer": 100, "decode.full_kv": 900},
            "sparse: decode.hot",
        ),
        ({}, {"decode.indexer": 100, "decode.full_kv": 900}, "sparse: decode.indexer, sparse: decode.hot"),
        ({"decode.indexer": 100, "decode.hot": 50}, {"decode.indexer": 100}, "keep: decode.full_kv"),
    ],
)
def test_decode_report_device_kv_needs_bytes_under_every_kv_tag(sparse, keep, missing):
    r = _report(StepStats(hits=36, misses=12, h2d_bytes=12 * 32), {"sparse": sparse, "keep": keep})
    assert r["device_kv_ratio"] is None and r["goals_met"]["device_kv_ratio"] is False
    assert r["not_measured"] == {"device_kv_ratio": "the counting allocator holds no bytes under " + missing}


def test_decode_report_device_kv_reads_an_allocator_by_tag():
    alloc = DeviceAllocator("cpu")
    kept = [alloc.zeros((4, 8), torch.float32, "decode.indexer"), alloc.zeros((2,), torch.float32, "prefill.x")]
    assert decode_report.device_kv(alloc) == {"decode.indexer": 128} and len(kept) == 2


@pytest.mark.parametrize(
    ("equal", "prefetch_equal", "met"),
    [(True, None, True), (True, True, True), (False, None, False), (True, False, False)],
)
def test_decode_report_logits_equal_covers_every_decoder(equal, prefetch_equal, met):
    r = _report(StepStats(hits=36, misses=12, h2d_bytes=12 * 32), equal=equal, prefetch_equal=prefetch_equal)
    assert r["goals_met"]["logits_equal"] is met and r["logits_equal"] is equal
