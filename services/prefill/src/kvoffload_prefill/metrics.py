"""The prefill's Prometheus ``/metrics``: what both modes export (``PrefillMetrics``: requests by
outcome, host-pool bytes in use), to which each mode's app adds its own gauges (``app.Metrics``
for a P/D prefill, ``offload_app.Metrics`` offload-only)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest


class PrefillMetrics(ABC):
    """A registry with the metrics both modes export; a mode adds its gauges (``gauge``) and sets
    them in ``update``, before each export."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvoffload_prefill_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        self.pool_used = Gauge("kvoffload_prefill_pool_used_bytes", "Host-pool bytes in use", registry=self.registry)

    def gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(name, documentation, registry=self.registry)

    @abstractmethod
    def update(self) -> None:
        """Set the mode's own gauges from what the service counts now."""

    def render(self) -> bytes:
        self.update()
        self.pool_used.set(self.pool.stats().used_bytes)
        return generate_latest(self.registry)

    async def handle(self, request: web.Request) -> web.Response:
        """The ``/metrics`` route."""
        return web.Response(body=self.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})
