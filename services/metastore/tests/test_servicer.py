"""The servicers over a real gRPC server on 127.0.0.1 (a free port): status codes, metadata,
health, Stats, /metrics."""

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvoffload_metastore.config import MetaStoreConfig
from kvoffload_metastore.server import start
from kvoffload_proto.v1 import metastore_pb2 as pb
from kvoffload_proto.v1 import metastore_pb2_grpc, stats_pb2, stats_pb2_grpc

K = [bytes([i]) * 16 for i in range(1, 12)]
GEOMETRY = pb.PoolGeometry(
    block_size=4,
    plane_row_bytes=[8, 8],
    num_blocks=2,
    plane_labels=[pb.PlaneLabel(layer=0, kind="main"), pb.PlaneLabel(layer=0, kind="indexer")],
)


@pytest.fixture
def stub(channel):
    return metastore_pb2_grpc.MetaStoreStub(channel)


def register(stub, pool_id="p0", **kw):
    return stub.RegisterPool(
        pb.RegisterPoolRequest(pool_id=pool_id, segment_name=f"seg-{pool_id}", geometry=GEOMETRY, host="h", **kw),
        timeout=5,
    )


def status(fn, request):
    with pytest.raises(grpc.RpcError) as info:
        fn(request, timeout=5)
    return info.value


def test_register_alloc_write_lookup_lease_remove(stub):
    reply = register(stub)
    assert (reply.pool.pool_id, reply.pool.block_bytes, reply.world_size, reply.num_pools) == ("p0", 64, 2, 1)
    assert (reply.heartbeat_timeout_ms, reply.heartbeat_interval_ms, reply.lease_ttl_ms) == (5000, 1666, 1000)
    assert [(x.layer, x.kind) for x in reply.pool.geometry.plane_labels] == [(0, "main"), (0, "indexer")]
    a = stub.Alloc(pb.AllocRequest(keys=K[:2], pool_hint="p0", require_hint=True), timeout=5)
    assert (a.pool.segment_name, list(a.block_ids)) == ("seg-p0", [0, 1])
    for plane in (0, 1):
        done = stub.MarkWritten(pb.MarkWrittenRequest(keys=K[:1], plane=plane), timeout=5)
    assert list(done.complete) == [True]
    assert list(stub.Exists(pb.ExistsRequest(keys=K[:3]), timeout=5).exists) == [True, False, False]
    look = stub.Lookup(pb.LookupRequest(keys=[K[1], K[0]]), timeout=5)
    assert [(x.key, x.block_id, x.complete, list(x.written_planes)) for x in look.locations] == [
        (K[1], 1, False, []),
        (K[0], 0, True, [0, 1]),
    ]
    assert [p.pool_id for p in look.pools] == ["p0"]
    lease = stub.Lease(pb.LeaseRequest(keys=K[:1], holder="t"), timeout=5)
    assert lease.lease_id > 0 and lease.ttl_ms == 1000 and lease.locations[0].block_id == 0
    assert stub.RenewLease(pb.RenewLeaseRequest(lease_id=lease.lease_id, ttl_ms=50), timeout=5).ttl_ms == 50
    assert stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=5).released
    assert not stub.ReleaseLease(pb.ReleaseLeaseRequest(lease_id=lease.lease_id), timeout=5).released
    assert stub.Remove(pb.RemoveRequest(keys=K[:3]), timeout=5).removed == 2
    assert stub.Heartbeat(pb.HeartbeatRequest(pool_id="p0"), timeout=5).expires_in_ms == 5000
    dereg = stub.DeregisterPool(pb.DeregisterPoolRequest(pool_id="p0"), timeout=5)
    assert dereg.deregistered and dereg.dropped_objects == 0


def test_status_codes_and_trailing_metadata(stub):
    e = status(stub.Alloc, pb.AllocRequest(keys=K[:1]))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "no pool is registered" in e.details()
    register(stub, "p0")
    register(stub, "p1")
    e = status(stub.RegisterPool, pb.RegisterPoolRequest(pool_id="p2", segment_name="s2", geometry=GEOMETRY))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "world_size=2" in e.details()
    e = status(stub.RegisterPool, pb.RegisterPoolRequest(pool_id="p0", segment_name="other", geometry=GEOMETRY))
    assert e.code() == grpc.StatusCode.ALREADY_EXISTS
    e = status(stub.RegisterPool, pb.RegisterPoolRequest(pool_id="p3", segment_name="s3"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "geometry is required" in e.details()
    e = status(
        stub.RegisterPool,
        pb.RegisterPoolRequest(
            pool_id="p0", segment_name="s", geometry=pb.PoolGeometry(block_size=0, plane_row_bytes=[8], num_blocks=1)
        ),
    )
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "block_size" in e.details()

    stub.Alloc(pb.AllocRequest(keys=K[:2], pool_hint="p0"), timeout=5)
    e = status(stub.Alloc, pb.AllocRequest(keys=[K[5], K[0]], pool_hint="p0"))
    assert e.code() == grpc.StatusCode.ALREADY_EXISTS and repr(K[0]) in e.details()
    md = dict(e.trailing_metadata())
    assert md["kvoffload-error"] == "ObjectExists" and md["kvoffload-key-bin"] == K[0]
    e = status(stub.Alloc, pb.AllocRequest(keys=K[5:8], pool_hint="p0", require_hint=True))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "3 block(s) needed, 0 free + 0 evictable of 2" in e.details() and "pool 'p0'" in e.details()
    md = dict(e.trailing_metadata())
    assert (md["kvoffload-needed-blocks"], md["kvoffload-free-blocks"], md["kvoffload-num-blocks"]) == ("3", "0", "2")
    e = status(stub.Alloc, pb.AllocRequest(keys=[b""]))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "keys[0]" in e.details()
    e = status(stub.Alloc, pb.AllocRequest(keys=K[8:9], pool_hint="nope"))
    assert e.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e.details()
    e = status(stub.Lookup, pb.LookupRequest(keys=[K[9]]))
    assert e.code() == grpc.StatusCode.NOT_FOUND and repr(K[9]) in e.details()
    e = status(stub.MarkWritten, pb.MarkWrittenRequest(keys=K[:1], plane=7))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "plane" in e.details()
    e = status(stub.Lease, pb.LeaseRequest(keys=K[:1], ttl_ms=86_400_001))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "ttl_ms" in e.details()
    stub.Lease(pb.LeaseRequest(keys=K[:1]), timeout=5)
    e = status(stub.Remove, pb.RemoveRequest(keys=K[:2]))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and repr(K[0]) in e.details()
    e = status(stub.RenewLease, pb.RenewLeaseRequest(lease_id=999))
    assert e.code() == grpc.StatusCode.NOT_FOUND and "lease 999" in e.details()
    e = status(stub.Heartbeat, pb.HeartbeatRequest(pool_id="ghost"))
    assert e.code() == grpc.StatusCode.NOT_FOUND and "'ghost'" in e.details()


def test_dry_run_alloc_changes_nothing(stub):
    register(stub)
    reply = stub.Alloc(pb.AllocRequest(keys=K[:2], dry_run=True), timeout=5)
    assert reply.pool.pool_id == "p0" and list(reply.block_ids) == []
    assert stub.Stats(pb.MetaStatsRequest(), timeout=5).objects == 0
    e = status(stub.Alloc, pb.AllocRequest(keys=K[:3], dry_run=True))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_heartbeat_expiry_over_the_wire(stub, clock):
    register(stub)
    stub.Alloc(pb.AllocRequest(keys=K[:1]), timeout=5)
    stub.Lease(pb.LeaseRequest(keys=K[:1], ttl_ms=60_000), timeout=5)
    clock.advance_ms(5000)
    s = stub.Stats(pb.MetaStatsRequest(), timeout=5)
    assert (len(s.pools), s.objects, s.live_leases, s.pools_expired, s.leases_dropped) == (0, 0, 0, 1, 1)
    e = status(stub.Heartbeat, pb.HeartbeatRequest(pool_id="p0"))
    assert e.code() == grpc.StatusCode.NOT_FOUND and "expired" in e.details()


def test_health_is_serving_then_not_serving_on_shutdown(clock):
    server = start(MetaStoreConfig(port=0), clock=clock)
    with grpc.insecure_channel(server.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "kvoffload.v1.MetaStore", "kvoffload.v1.Stats"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        server.health.enter_graceful_shutdown()
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    server.shutdown(grace_s=0)


def test_stats_service_fields(stub, channel):
    register(stub)
    stub.Alloc(pb.AllocRequest(keys=K[:1]), timeout=5)
    status(stub.Lookup, pb.LookupRequest(keys=[K[5]]))
    reply = stats_pb2_grpc.StatsStub(channel).GetStats(stats_pb2.StatsRequest(include_ledger=True), timeout=5)
    assert (reply.service, reply.version) == ("kvoffload-metastore", "0.1.0")
    c = reply.counters
    assert (c["pools"], c["objects"], c["live_leases"], c["lease_expiries_total"]) == (1, 1, 0, 0)
    assert c["pool.p0.used_blocks"] == 1 and c["pool.p0.used_bytes"] == 64 and c["pool.p0.capacity_bytes"] == 128
    assert c["dram_bytes_per_local_service"] == 10 * 2**30 and c["lease_ttl_ms"] == 1000
    assert c["requests_total.Alloc.OK"] == 1 and c["requests_total.Lookup.NOT_FOUND"] == 1
    assert reply.info["bind_address"].startswith("127.0.0.1:") and reply.ledger_json == '{"requests": []}'
    meta = stub.Stats(pb.MetaStatsRequest(), timeout=5)
    assert (meta.world_size, meta.dram_bytes_per_local_service, meta.used_bytes) == (2, 10 * 2**30, 64)
    assert meta.pools[0].pool.pool_id == "p0" and meta.pools[0].free_blocks == 1


def test_metrics_endpoint(clock):
    server = start(MetaStoreConfig(port=0, metrics_port=_free_port()), clock=clock)
    try:
        with grpc.insecure_channel(server.target) as ch:
            stub = metastore_pb2_grpc.MetaStoreStub(ch)
            register(stub)
            stub.Alloc(pb.AllocRequest(keys=K[:1]), timeout=5)
            status(stub.Heartbeat, pb.HeartbeatRequest(pool_id="x"))
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown(grace_s=0)
    for line in (
        'kvoffload_metastore_pool_used_blocks{pool="p0"} 1.0',
        'kvoffload_metastore_pool_occupancy_ratio{pool="p0"} 0.5',
        "kvoffload_metastore_live_leases 0.0",
        "kvoffload_metastore_lease_expiries_total 0.0",
        "kvoffload_metastore_evictions_total 0.0",
        'kvoffload_metastore_requests_total{code="OK",method="Alloc"} 1.0',
        'kvoffload_metastore_requests_total{code="NOT_FOUND",method="Heartbeat"} 1.0',
    ):
        assert line in text, line


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
