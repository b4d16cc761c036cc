"""Thin servicers: proto <-> ``MetaStoreCore`` calls, errors -> gRPC status codes (``poolbackends.wire``).

``MetaStoreServicer`` serves ``kvoffload.v1.MetaStore``; ``StatsServicer`` serves the generic
``kvoffload.v1.Stats``. Neither holds state of its own beyond the request counters.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from kvoffload_metastore.core import MetaStoreCore
from kvoffload_metastore.metrics import MetaMetrics, stats_counters
from kvoffload_metastore.records import PoolOccupancy
from kvoffload_proto.v1 import metastore_pb2 as pb
from kvoffload_proto.v1 import metastore_pb2_grpc, stats_pb2, stats_pb2_grpc
from poolbackends import wire
from poolbackends.wire import geometry_from_pb, location_to_pb, pool_to_pb

log = structlog.get_logger("kvoffload_metastore.servicer")


# ---- conversions -------------------------------------------------------------------------------


def occupancy_to_pb(p: PoolOccupancy) -> pb.PoolStats:
    return pb.PoolStats(
        pool=pool_to_pb(p.pool),
        used_blocks=p.used_blocks,
        free_blocks=p.free_blocks,
        used_bytes=p.used_bytes,
        capacity_bytes=p.capacity_bytes,
        objects=p.objects,
        complete_objects=p.complete_objects,
        evictions=p.evictions,
        heartbeat_age_ms=p.heartbeat_age_ms,
    )


def _unix_ms_in(ttl_ms: int) -> int:
    return int(time.time() * 1000) + ttl_ms


# ---- the MetaStore servicer --------------------------------------------------------------------


def _rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run one RPC: count it, turn known errors into their status code, log unexpected ones."""
    method = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: MetaStoreServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            reply = fn(self, request, context)
        except Exception as exc:  # every error becomes a status
            code = wire.status_of(exc)
            if code is None:
                log.exception("rpc failed", method=method)
                code, message = grpc.StatusCode.INTERNAL, f"{method}: internal error: {type(exc).__name__}: {exc}"
            else:
                message = wire.message_of(exc)
                log.debug("rpc refused", method=method, code=code.name, error=message)
            self.metrics.observe(method, code.name)
            context.set_trailing_metadata(wire.trailing_metadata(exc))
            context.abort(code, message)
        self.metrics.observe(method, "OK")
        return reply

    return wrapper


class MetaStoreServicer(metastore_pb2_grpc.MetaStoreServicer):
    def __init__(self, core: MetaStoreCore, metrics: MetaMetrics) -> None:
        self.core = core
        self.metrics = metrics

    @_rpc
    def RegisterPool(self, request: pb.RegisterPoolRequest, context: grpc.ServicerContext) -> pb.RegisterPoolReply:
        if not request.HasField("geometry"):
            raise ValueError(f"RegisterPool of {request.pool_id!r}: geometry is required")
        record = self.core.register_pool(
            request.pool_id,
            request.segment_name,
            geometry_from_pb(request.geometry),
            request.host,
            replace=request.replace,
        )
        c = self.core
        return pb.RegisterPoolReply(
            pool=pool_to_pb(record),
            heartbeat_timeout_ms=c.heartbeat_timeout_ms,
            heartbeat_interval_ms=max(1, c.heartbeat_timeout_ms // 3),
            lease_ttl_ms=c.lease_ttl_ms,
            world_size=c.world_size,
            num_pools=len(c.pools()),
        )

    @_rpc
    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        return pb.HeartbeatReply(expires_in_ms=self.core.heartbeat(request.pool_id))

    @_rpc
    def DeregisterPool(
        self, request: pb.DeregisterPoolRequest, context: grpc.ServicerContext
    ) -> pb.DeregisterPoolReply:
        was, objects, leases = self.core.deregister_pool(request.pool_id)
        return pb.DeregisterPoolReply(deregistered=was, dropped_objects=objects, dropped_leases=leases)

    @_rpc
    def Alloc(self, request: pb.AllocRequest, context: grpc.ServicerContext) -> pb.AllocReply:
        if request.dry_run:
            pool, evicted = self.core.check_alloc(list(request.keys), request.pool_hint or None, request.require_hint)
            return pb.AllocReply(pool=pool_to_pb(pool), evicted_objects=evicted)
        a = self.core.alloc(list(request.keys), request.pool_hint or None, request.require_hint)
        return pb.AllocReply(pool=pool_to_pb(a.pool), block_ids=a.block_ids, evicted_objects=a.evicted)

    @_rpc
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupReply:
        locations = self.core.lookup(list(request.keys))
        wanted = {loc.pool_id for loc in locations}
        pools = [pool_to_pb(r) for r in self.core.pools() if r.pool_id in wanted]
        return pb.LookupReply(locations=[location_to_pb(loc) for loc in locations], pools=pools)

    @_rpc
    def Exists(self, request: pb.ExistsRequest, context: grpc.ServicerContext) -> pb.ExistsReply:
        return pb.ExistsReply(exists=self.core.exists(list(request.keys)))

    @_rpc
    def MarkWritten(self, request: pb.MarkWrittenRequest, context: grpc.ServicerContext) -> pb.MarkWrittenReply:
        planes = list(request.planes) or request.plane
        return pb.MarkWrittenReply(complete=self.core.mark_written(list(request.keys), planes))

    @_rpc
    def Remove(self, request: pb.RemoveRequest, context: grpc.ServicerContext) -> pb.RemoveReply:
        return pb.RemoveReply(removed=self.core.remove(list(request.keys)))

    @_rpc
    def Lease(self, request: pb.LeaseRequest, context: grpc.ServicerContext) -> pb.LeaseReply:
        g = self.core.lease(list(request.keys), request.ttl_ms or None, request.holder)
        return pb.LeaseReply(
            lease_id=g.lease_id,
            ttl_ms=g.ttl_ms,
            deadline_unix_ms=_unix_ms_in(g.ttl_ms),
            locations=[location_to_pb(loc) for loc in g.locations],
        )

    @_rpc
    def RenewLease(self, request: pb.RenewLeaseRequest, context: grpc.ServicerContext) -> pb.RenewLeaseReply:
        ttl_ms, _ = self.core.renew_lease(request.lease_id, request.ttl_ms or None)
        return pb.RenewLeaseReply(ttl_ms=ttl_ms, deadline_unix_ms=_unix_ms_in(ttl_ms))

    @_rpc
    def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext) -> pb.ReleaseLeaseReply:
        return pb.ReleaseLeaseReply(released=self.core.release_lease(request.lease_id))

    @_rpc
    def Stats(self, request: pb.MetaStatsRequest, context: grpc.ServicerContext) -> pb.MetaStatsReply:
        s = self.core.stats()
        return pb.MetaStatsReply(
            pools=[occupancy_to_pb(p) for p in s.pools],
            world_size=s.world_size,
            lease_ttl_ms=s.lease_ttl_ms,
            heartbeat_timeout_ms=s.heartbeat_timeout_ms,
            dram_bytes_per_local_service=s.dram_bytes_per_local_service,
            objects=s.objects,
            complete_objects=s.complete_objects,
            live_leases=s.live_leases,
            lease_expiries=s.lease_expiries,
            leases_dropped=s.leases_dropped,
            evictions=s.evictions,
            pools_expired=s.pools_expired,
            used_bytes=s.used_bytes,
            capacity_bytes=s.capacity_bytes,
        )


# ---- the generic Stats servicer ----------------------------------------------------------------


class StatsServicer(stats_pb2_grpc.StatsServicer):
    """``kvoffload.v1.Stats`` for the metastore: core counters, request counts, static info."""

    def __init__(
        self, service: str, version: str, core: MetaStoreCore, metrics: MetaMetrics, info: dict[str, str]
    ) -> None:
        self._service, self._version, self._core, self._metrics = service, version, core, metrics
        self._info = dict(info)
        self._started = time.monotonic()

    def GetStats(self, request: stats_pb2.StatsRequest, context: grpc.ServicerContext) -> stats_pb2.StatsReply:
        counters = stats_counters(self._core.stats(), self._metrics.request_counts())
        ledger = json.dumps({"requests": []}) if request.include_ledger else ""  # the metastore tracks no requests
        self._metrics.observe("GetStats", "OK")
        return stats_pb2.StatsReply(
            service=self._service,
            version=self._version,
            counters=counters,
            info=self._info,
            ledger_json=ledger,
            uptime_ms=int((time.monotonic() - self._started) * 1000),
        )
