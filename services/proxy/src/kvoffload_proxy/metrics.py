"""Prometheus metrics of one proxy app (own registry, so several apps can live in one process).

Backend loads are read from the balancers at scrape time, so the exported numbers are the
accounting itself and cannot drift from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .balancer import Balancer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _LoadCollector(Collector):
    def __init__(self, balancers: Iterable[Balancer], open_requests: Callable[[], int]):
        self._balancers = list(balancers)
        self._open_requests = open_requests

    def collect(self):
        labels = ["role", "backend"]
        reqs = GaugeMetricFamily(
            "kvoffload_proxy_backend_active_requests", "Requests the proxy has in flight on each backend", labels=labels
        )
        toks = GaugeMetricFamily(
            "kvoffload_proxy_backend_active_tokens", "Estimated tokens in flight on each backend", labels=labels
        )
        kv = GaugeMetricFamily(
            "kvoffload_proxy_backend_active_kv_tokens",
            "Estimated KV tokens a prefiller holds until decoders pulled them",
            labels=labels,
        )
        queued = GaugeMetricFamily(
            "kvoffload_proxy_decoder_queue_depth",
            "Requests a decoder last reported queued (admitted, not yet in its batch)",
            labels=labels,
        )
        free = GaugeMetricFamily(
            "kvoffload_proxy_decoder_free_pool_bytes", "Free host-pool bytes a decoder last reported", labels=labels
        )
        rejected = CounterMetricFamily(
            "kvoffload_proxy_backend_rejections", "429 answers (queue full) from each backend", labels=labels
        )
        for bal in self._balancers:
            for load in bal.loads:
                key = [load.backend.role, load.backend.url]
                reqs.add_metric(key, load.num_active_requests)
                toks.add_metric(key, load.num_active_tokens)
                kv.add_metric(key, load.num_active_kv_tokens)
                rejected.add_metric(key, load.rejections)
                if load.backend.role == "decoder":
                    queued.add_metric(key, load.reported.get("queued", 0))
                    free.add_metric(key, load.reported.get("free_pool_bytes", 0))
        yield from (reqs, toks, kv, queued, free, rejected)
        yield GaugeMetricFamily(
            "kvoffload_proxy_open_rendezvous",
            "Client requests waiting on or holding a metaserver registration",
            value=self._open_requests(),
        )


class ProxyMetrics:
    def __init__(self, balancers: Iterable[Balancer], open_requests: Callable[[], int]):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvoffload_proxy_requests",
            "Client requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "kvoffload_proxy_rejected_requests",
            "Client requests answered 429 because every decoder's queue was full",
            registry=self.registry,
        )
        self.retries = Counter(
            "kvoffload_proxy_backend_retries",
            "Backend connections retried after a transport error",
            ["role", "backend"],
            registry=self.registry,
        )
        self.metaserver_latency = Histogram(
            "kvoffload_proxy_metaserver_latency_seconds",
            "Time from a decoder's /v1/metaserver call to its answer (includes the prefill)",
            ["outcome"],
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
        )
        self.registry.register(_LoadCollector(balancers, open_requests))

    def render(self) -> bytes:
        return generate_latest(self.registry)
