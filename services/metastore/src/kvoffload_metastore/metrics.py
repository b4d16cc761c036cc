"""Metrics of the metastore: Prometheus ``/metrics`` and the counters of the ``Stats`` RPC.

Both read the same sources: ``MetaStoreCore.stats()`` at scrape time (pool occupancy, objects,
live leases, lease expiries, evictions) and ``requests_total`` by method and status code, which
the servicer counts. Each server gets its own registry, so tests and several servers in one
process never collide.
"""

from __future__ import annotations

from collections.abc import Iterator
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvoffload_metastore.core import MetaStoreCore
from kvoffload_metastore.records import MetaStats

PREFIX = "kvoffload_metastore"


class _CoreCollector(Collector):
    def __init__(self, core: MetaStoreCore) -> None:
        self._core = core

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._core.stats()
        per_pool = {
            "pool_used_blocks": ("blocks allocated in the pool", lambda p: p.used_blocks),
            "pool_capacity_blocks": ("blocks of the pool", lambda p: p.pool.geometry.num_blocks),
            "pool_used_bytes": ("bytes allocated in the pool", lambda p: p.used_bytes),
            "pool_capacity_bytes": ("bytes of the pool", lambda p: p.capacity_bytes),
            "pool_occupancy_ratio": ("used / capacity blocks", lambda p: p.used_blocks / p.pool.geometry.num_blocks),
            "pool_objects": ("objects in the pool (complete or not)", lambda p: p.objects),
            "pool_heartbeat_age_seconds": ("since the pool's last heartbeat", lambda p: p.heartbeat_age_ms / 1000),
        }
        for name, (doc, get) in per_pool.items():
            g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["pool"])
            for p in s.pools:
                g.add_metric([p.pool.pool_id], float(get(p)))
            yield g
        for name, doc, value in (
            ("pools", "registered pools", len(s.pools)),
            ("world_size", "most pools that may register", s.world_size),
            ("objects", "objects (complete or not)", s.objects),
            ("complete_objects", "complete objects", s.complete_objects),
            ("live_leases", "live read leases", s.live_leases),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))
        for name, doc, value in (
            ("lease_expiries", "leases that reached their deadline unreleased", s.lease_expiries),
            ("leases_dropped", "leases dropped with an expired or replaced pool", s.leases_dropped),
            ("evictions", "objects evicted to make room", s.evictions),
            ("pools_expired", "pools dropped for missing heartbeats", s.pools_expired),
        ):
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))


class MetaMetrics:
    """The registry of one server: core gauges plus ``requests_total{method, code}``."""

    def __init__(self, core: MetaStoreCore) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            f"{PREFIX}_requests", "RPCs handled, by method and status code", ["method", "code"], registry=self.registry
        )
        self.registry.register(_CoreCollector(core))
        self._http: tuple[WSGIServer, Thread] | None = None

    def observe(self, method: str, code: str) -> None:
        self._requests.labels(method, code).inc()

    def request_counts(self) -> dict[tuple[str, str], float]:
        return {
            (s.labels["method"], s.labels["code"]): s.value
            for m in self._requests.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }

    def start_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port``; returns the bound port."""
        self._http = start_http_server(port, addr=host, registry=self.registry)
        return self._http[0].server_port

    def stop_http(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None


def stats_counters(s: MetaStats, requests: dict[tuple[str, str], float]) -> dict[str, float]:
    """Flat counters of the ``Stats`` RPC (names with units; per-pool as ``pool.<id>.<name>``)."""
    out: dict[str, float] = {
        "pools": len(s.pools),
        "world_size": s.world_size,
        "objects": s.objects,
        "complete_objects": s.complete_objects,
        "live_leases": s.live_leases,
        "lease_expiries_total": s.lease_expiries,
        "leases_dropped_total": s.leases_dropped,
        "evictions_total": s.evictions,
        "pools_expired_total": s.pools_expired,
        "used_bytes": s.used_bytes,
        "capacity_bytes": s.capacity_bytes,
        "lease_ttl_ms": s.lease_ttl_ms,
        "heartbeat_timeout_ms": s.heartbeat_timeout_ms,
        "dram_bytes_per_local_service": s.dram_bytes_per_local_service,
    }
    for p in s.pools:
        base = f"pool.{p.pool.pool_id}."
        out.update(
            {
                base + "used_blocks": p.used_blocks,
                base + "free_blocks": p.free_blocks,
                base + "used_bytes": p.used_bytes,
                base + "capacity_bytes": p.capacity_bytes,
                base + "objects": p.objects,
                base + "complete_objects": p.complete_objects,
                base + "evictions_total": p.evictions,
                base + "heartbeat_age_ms": p.heartbeat_age_ms,
            }
        )
    for (method, code), n in requests.items():
        out[f"requests_total.{method}.{code}"] = n
    return {k: float(v) for k, v in out.items()}
