"""The decode's Prometheus ``/metrics`` (``Metrics``): the hot cache and host-to-device traffic of
the last step, the queue and the batch, the pulls (READ_DONE count and latency, bytes by prefill TP
rank) and requests by outcome (counted by the HTTP API, ``kvoffload_decode.app``)."""

from __future__ import annotations

from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvoffload_decode.loop import DecodeLoop
from pdlink.pullcounters import BY_RANK


class Metrics:
    """The decode's Prometheus registry (module doc); ``render`` reads the loop and the transfer."""

    def __init__(self, loop: DecodeLoop, transfer) -> None:
        self.registry = CollectorRegistry()
        gauge, counter = partial(Gauge, registry=self.registry), partial(Counter, registry=self.registry)
        self.requests = counter("kvoffload_decode_requests", "Requests by outcome", ["outcome"])
        self.hit_rate = gauge("kvoffload_decode_hot_cache_hit_rate", "Hot-cache hit rate of the last step")
        self.layer_hit_rate = gauge(
            "kvoffload_decode_hot_cache_hit_rate_by_layer",
            "Hot-cache hit rate of the last step, per cache layer",
            ["layer"],
        )
        self.h2d = gauge("kvoffload_decode_h2d_bytes_per_step", "Host-to-device bytes of the last step")
        self.prefetched = gauge(
            "kvoffload_decode_prefetched_rows_per_step",
            "Rows the miss prefetch loaded early in the last step (0 with it off)",
        )
        self.prefetch_hits = gauge(
            "kvoffload_decode_prefetch_hits_per_step",
            "Misses of the last step served by rows the prefetch had loaded early",
        )
        self.pool_used = gauge("kvoffload_decode_pool_used_bytes", "Host-pool bytes in use")
        self.pool_capacity = gauge(
            "kvoffload_decode_pool_capacity_bytes", "Host-pool bytes of this DP rank (one pool, its TP ranks share it)"
        )
        self.reads = gauge("kvoffload_decode_read_done_total", "Layer pulls answered READ_DONE")
        self.bytes_by_rank = gauge(
            "kvoffload_decode_bytes_read_by_prefill_tp_rank",
            "Bytes pulled out of each prefill TP rank's layer buffers (its share of every layer)",
            ["prefill_tp_rank"],
        )
        self.read_ms = gauge("kvoffload_decode_read_done_ms_avg", "Average READ_DONE latency (ms)")
        self.queued = gauge("kvoffload_decode_queued_requests", "Requests admitted, not in the running batch yet")
        self.waiting = gauge("kvoffload_decode_waiting_for_blocks", "Queued requests still waiting for host blocks")
        self.running = gauge("kvoffload_decode_running_requests", "Requests in the running batch")
        self.rejected = counter(
            "kvoffload_decode_rejected",
            "Requests refused with 429 at admission: the queue full, or its estimated wait past --max-queue-wait-s",
        )
        self.queue_timeouts = gauge(
            "kvoffload_decode_queue_timeouts_total", "Queued requests refused with 429 after --max-queue-wait-s"
        )
        self.start_interval = gauge(
            "kvoffload_decode_start_interval_seconds",
            "The queue's pace: seconds between request starts under a backlog (0 until measured)",
        )
        self.gather_waits = gauge(
            "kvoffload_decode_gather_waits_total",
            "Steps held at saturation for requests on their way (--step-gather-ms)",
        )
        self.gather_wait_s = gauge(
            "kvoffload_decode_gather_wait_seconds_total", "Seconds steps were held at saturation"
        )
        self.loop, self.transfer = loop, transfer

    def render(self) -> bytes:
        st = self.loop.decoder.last_step
        self.hit_rate.set(st.hit_rate)
        for layer in set(st.layer_hits) | set(st.layer_misses):
            self.layer_hit_rate.labels(str(layer)).set(st.layer_hit_rate(layer))
        self.h2d.set(st.h2d_bytes)
        self.prefetched.set(st.prefetched)
        self.prefetch_hits.set(st.prefetch_hits)
        pool = self.loop.decoder.pool.stats()
        self.pool_used.set(pool.used_bytes)
        self.pool_capacity.set(pool.capacity_bytes)
        stats = self.loop.stats()
        self.queued.set(stats["queued"])
        self.waiting.set(stats["waiting_for_blocks"])
        self.running.set(stats["running"])
        self.gather_waits.set(stats["gather_waits"])
        self.gather_wait_s.set(stats["gather_wait_s"])
        self.queue_timeouts.set(stats["queue_timeouts"])
        self.start_interval.set(stats["start_interval_s"])
        c = self.transfer.counters
        self.reads.set(c["read_done"])
        self.read_ms.set(c["read_ms_total"] / c["read_done"] if c["read_done"] else 0.0)
        for name, value in c.items():
            if name.startswith(BY_RANK):
                self.bytes_by_rank.labels(name.removeprefix(BY_RANK)).set(value)
        return generate_latest(self.registry)
