"""The connectors' Prometheus counters: every series exists, at 0, from the start (a reader can tell
"nothing counted yet" from "not exported"), and ``observe`` adds to the engine's own series."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvoffload_testing.prom import Metrics
from kvoffload_vllm.stats import CounterPromMetrics


def test_every_counter_is_exported_at_zero_before_its_first_increment_then_counts_per_engine():
    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)}
    prom = CounterPromMetrics(
        SimpleNamespace(kv_transfer_config=None),
        types,
        ["engine"],
        {0: ["0"], 1: ["1"]},
        connector="d2h_consumer",
        counters={"requests_pulled": "pulled", "bytes_pulled": "bytes"},
    )
    before = Metrics.parse(generate_latest(registry).decode())
    for name in ("vllm:kvoffload_d2h_consumer_requests_pulled_total", "vllm:kvoffload_d2h_consumer_bytes_pulled_total"):
        assert sorted(before.values(name)) == [0.0, 0.0]  # one series per engine
    prom.observe({"requests_pulled": 2, "bytes_pulled": 4096}, engine_idx=1)
    after = Metrics.parse(generate_latest(registry).decode())
    assert after.total("vllm:kvoffload_d2h_consumer_requests_pulled_total", engine="1") == 2
    assert after.total("vllm:kvoffload_d2h_consumer_requests_pulled_total", engine="0") == 0
