"""``kvoffload_testing.prom``: the Prometheus reader of checks and benches. A metric missing from the text
raises naming it (a renamed or dropped metric must fail the check that reads it, not read 0), names
match exactly and labels select; the texts are the proxy's and the decode's own exports."""

from __future__ import annotations

import http.server
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvoffload_testing.prom import Metrics, MissingMetric, metric


def test_a_metric_missing_from_the_text_raises_naming_it(proxy_text):
    m = Metrics.parse(proxy_text, source="proxy/metrics")
    assert m.total("kvoffload_proxy_rejected_requests_total") == 0  # there, and 0
    with pytest.raises(MissingMetric, match=r"proxy/metrics: no sample named 'kvoffload_proxy_rejected_total'"):
        m.total("kvoffload_proxy_rejected_total")  # renamed: an error, not a 0


def test_a_labelled_counter_without_a_series_is_declared_but_has_no_value(proxy_text):
    m = Metrics.parse(proxy_text)
    assert m.declares("kvoffload_proxy_backend_retries_total") and m.declares("kvoffload_proxy_requests_total")
    assert m.declares("kvoffload_proxy_metaserver_latency_seconds_sum")
    assert not m.declares("kvoffload_proxy_retries_total")
    with pytest.raises(MissingMetric, match="declared, but no series yet"):
        m.total("kvoffload_proxy_backend_retries_total")


def test_names_match_exactly_and_labels_select():
    reg = CollectorRegistry()
    Gauge("kvoffload_decode_queued_requests", "q", registry=reg).set(2)
    Gauge("kvoffload_decode_queued_requests_peak", "p", registry=reg).set(7)  # a prefix of another name
    by_source = Counter("vllm:prompt_tokens_by_source", "s", ["source"], registry=reg)
    by_source.labels("local_compute").inc(3)
    by_source.labels("external_kv_transfer").inc(40)
    m = Metrics.parse(generate_latest(reg).decode())
    assert m.total("kvoffload_decode_queued_requests") == 2
    assert m.total("vllm:prompt_tokens_by_source_total") == 43
    assert m.total("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 40
    with pytest.raises(MissingMetric, match=r'source="local_cache_hit".*source="external_kv_transfer"'):
        m.total("vllm:prompt_tokens_by_source_total", source="local_cache_hit")  # lists the series there are


def test_the_decodes_own_metrics_are_read_by_name():
    """Every name ``tests/integration/test_load.py`` reads from a decode, in a decode's real export."""
    from types import SimpleNamespace

    from kvoffload_decode.metrics import Metrics as DecodeMetrics

    stats = {"queued": 0, "waiting_for_blocks": 0, "running": 0, "rejected": 3, "gather_waits": 5, "gather_wait_s": 0.5}
    stats |= {"queue_timeouts": 2, "start_interval_s": 0.25}  # the queue-wait bound's
    step = SimpleNamespace(hit_rate=0.0, layer_hits={}, layer_misses={}, h2d_bytes=0, prefetched=0, prefetch_hits=0)
    pool = SimpleNamespace(stats=lambda: SimpleNamespace(used_bytes=0, capacity_bytes=1 << 30))
    loop = SimpleNamespace(decoder=SimpleNamespace(last_step=step, pool=pool), stats=lambda: stats)
    transfer = SimpleNamespace(counters={"read_done": 0, "read_ms_total": 0.0})
    text = DecodeMetrics(loop, transfer).render().decode()
    m = Metrics.parse(text)
    assert m.total("kvoffload_decode_queued_requests") == 0
    assert m.total("kvoffload_decode_gather_waits_total") == 5
    assert m.total("kvoffload_decode_rejected_total") == 0  # counted by the app, not from Stats
    assert m.total("kvoffload_decode_queue_timeouts_total") == 2
    assert m.total("kvoffload_decode_start_interval_seconds") == 0.25
    assert m.total("kvoffload_decode_pool_capacity_bytes") == 1 << 30  # the DP rank's one pool


def test_metric_reads_a_servers_metrics_over_http():
    body = b'# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n'

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert metric(url, "vllm:kv_cache_usage_perc") == 0.25
        with pytest.raises(MissingMetric, match=f"{url}/metrics: no sample named 'vllm:gpu_cache_usage_perc'"):
            metric(url, "vllm:gpu_cache_usage_perc")
    finally:
        server.shutdown()
        server.server_close()
