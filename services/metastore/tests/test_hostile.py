"""Hostile MetaStore messages over a real gRPC server on 127.0.0.1: each malformed, out-of-range or
unknown-key message is rejected with its status code (or the explicit "nothing done" reply the proto
defines) and changes nothing — the Stats counters (kvoffload.v1.Stats, minus the request counts),
the MetaStore.Stats occupancy and every object's location are the same before and after."""

from __future__ import annotations

import grpc
import pytest

from kvoffload_metastore.config import MetaStoreConfig
from kvoffload_metastore.server import start
from kvoffload_proto.v1 import metastore_pb2 as pb
from kvoffload_proto.v1 import metastore_pb2_grpc, stats_pb2, stats_pb2_grpc

K0, K1, K2 = b"k0" * 8, b"k1" * 8, b"k2" * 8  # K0 complete and leased, K1 allocated (incomplete), K2 absent
GEOMETRY = pb.PoolGeometry(
    block_size=4,
    plane_row_bytes=[8, 8],
    num_blocks=4,
    plane_labels=[pb.PlaneLabel(layer=0, kind="main"), pb.PlaneLabel(layer=0, kind="indexer")],
)
U32_MAX, U64_MAX = 2**32 - 1, 2**64 - 1
NEGATIVE_ONE = b"\xff" * 9 + b"\x01"  # the varint a sender writes for -1 as int64 (read back as the max unsigned)

C = grpc.StatusCode


@pytest.fixture
def running(clock):
    """This module's server (room for three pools, long TTLs); ``channel`` comes from conftest."""
    server = start(MetaStoreConfig(port=0, world_size=3, lease_ttl_ms=60_000, heartbeat_timeout_ms=60_000), clock=clock)
    yield server
    server.shutdown(grace_s=0)


@pytest.fixture
def stub(channel):
    """A MetaStore with two pools (room for a third), K0 complete and leased, K1 incomplete."""
    s = metastore_pb2_grpc.MetaStoreStub(channel)
    for pool_id in ("p0", "p1"):
        s.RegisterPool(
            pb.RegisterPoolRequest(pool_id=pool_id, segment_name=f"seg-{pool_id}", geometry=GEOMETRY, host="h"),
            timeout=5,
        )
    s.Alloc(pb.AllocRequest(keys=[K0, K1], pool_hint="p0", require_hint=True), timeout=5)
    for plane in (0, 1):
        s.MarkWritten(pb.MarkWrittenRequest(keys=[K0], plane=plane), timeout=5)
    s.MarkWritten(pb.MarkWrittenRequest(keys=[K1], plane=0), timeout=5)
    s.lease_id = s.Lease(pb.LeaseRequest(keys=[K0], holder="test"), timeout=5).lease_id
    return s


def snapshot(stub, channel) -> tuple:
    """Everything a hostile message could have changed."""
    counters = stats_pb2_grpc.StatsStub(channel).GetStats(stats_pb2.StatsRequest(), timeout=5).counters
    state = {k: v for k, v in counters.items() if not k.startswith("requests_total.")}
    occupancy = stub.Stats(pb.MetaStatsRequest(), timeout=5).SerializeToString(deterministic=True)
    where = stub.Lookup(pb.LookupRequest(keys=[K0, K1]), timeout=5).SerializeToString(deterministic=True)
    exists = list(stub.Exists(pb.ExistsRequest(keys=[K0, K1, K2]), timeout=5).exists)
    return state, occupancy, where, exists


def raw(channel, method: str, reply):
    """A caller that sends bytes as they are (messages no well-behaved client would encode)."""
    return channel.unary_unary(
        f"/kvoffload.v1.MetaStore/{method}", request_serializer=lambda b: b, response_deserializer=reply.FromString
    )


# (id, method, request, status code, text the message must contain)
# a table laid out by hand (one case per row, its request and expected reply aligned): not reformatted
# fmt: off
REJECTED = [
    # -- registration: sizes --
    ("register-block-size-0", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2",
                            geometry=pb.PoolGeometry(block_size=0, plane_row_bytes=[8], num_blocks=2)),
     C.INVALID_ARGUMENT, "block_size must be an int >= 1, got 0"),
    ("register-no-planes", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2",
                            geometry=pb.PoolGeometry(block_size=4, num_blocks=2)),
     C.INVALID_ARGUMENT, "plane_row_bytes must name at least one plane"),
    ("register-row-bytes-0", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2",
                            geometry=pb.PoolGeometry(block_size=4, plane_row_bytes=[8, 0], num_blocks=2)),
     C.INVALID_ARGUMENT, "plane_row_bytes[1] must be an int >= 1, got 0"),
    ("register-no-blocks", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2",
                            geometry=pb.PoolGeometry(block_size=4, plane_row_bytes=[8], num_blocks=0)),
     C.INVALID_ARGUMENT, "num_blocks must be an int >= 1, got 0"),
    ("register-huge-num-blocks", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2",
                            geometry=pb.PoolGeometry(block_size=4, plane_row_bytes=[8], num_blocks=U64_MAX)),
     C.INVALID_ARGUMENT, "is more than a pool may hold"),
    ("register-huge-rows", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2",
                            geometry=pb.PoolGeometry(block_size=U32_MAX, plane_row_bytes=[U64_MAX], num_blocks=1)),
     C.INVALID_ARGUMENT, "is more than a pool may hold"),
    ("register-labels-count", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2", geometry=pb.PoolGeometry(
         block_size=4, plane_row_bytes=[8, 8], num_blocks=2, plane_labels=[pb.PlaneLabel(layer=0, kind="main")])),
     C.INVALID_ARGUMENT, "plane_labels has 1 entries for 2 planes"),
    ("register-label-kind", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2", geometry=pb.PoolGeometry(
         block_size=4, plane_row_bytes=[8], num_blocks=2, plane_labels=[pb.PlaneLabel(layer=0, kind="evil")])),
     C.INVALID_ARGUMENT, "plane label (0, 'evil') must be"),
    ("register-labels-repeat", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2", geometry=pb.PoolGeometry(
         block_size=4, plane_row_bytes=[8, 8], num_blocks=2, plane_labels=[pb.PlaneLabel(layer=0, kind="main")] * 2)),
     C.INVALID_ARGUMENT, "plane_labels must be unique"),
    ("register-no-geometry", "RegisterPool", pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2"),
     C.INVALID_ARGUMENT, "geometry is required"),
    # -- registration: names --
    ("register-empty-pool-id", "RegisterPool", pb.RegisterPoolRequest(pool_id="", segment_name="s", geometry=GEOMETRY),
     C.INVALID_ARGUMENT, "pool_id must be 1..200 printable characters"),
    ("register-long-pool-id", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="x" * 201, segment_name="s", geometry=GEOMETRY),
     C.INVALID_ARGUMENT, "pool_id must be 1..200 printable characters"),
    ("register-control-chars-pool-id", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p\n2", segment_name="s", geometry=GEOMETRY),
     C.INVALID_ARGUMENT, "pool_id must be 1..200 printable characters"),
    ("register-segment-path-traversal", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p2", segment_name="../../etc/passwd", geometry=GEOMETRY),
     C.INVALID_ARGUMENT, "segment name must match"),
    ("register-empty-segment", "RegisterPool", pb.RegisterPoolRequest(pool_id="p2", segment_name="", geometry=GEOMETRY),
     C.INVALID_ARGUMENT, "segment name must match"),
    ("register-live-id-other-segment", "RegisterPool",
     pb.RegisterPoolRequest(pool_id="p0", segment_name="seg-other", geometry=GEOMETRY),
     C.ALREADY_EXISTS, "pool 'p0' is registered with segment 'seg-p0'"),
    ("heartbeat-unknown-pool", "Heartbeat", pb.HeartbeatRequest(pool_id="nope"),
     C.NOT_FOUND, "pool 'nope' is not registered"),
    # -- alloc --
    ("alloc-empty-key", "Alloc", pb.AllocRequest(keys=[K2, b""]), C.INVALID_ARGUMENT,
     "keys[1] must be bytes of length 1..512"),
    ("alloc-oversized-key", "Alloc", pb.AllocRequest(keys=[b"x" * 513]), C.INVALID_ARGUMENT,
     "keys[0] must be bytes of length 1..512"),
    ("alloc-duplicate-keys", "Alloc", pb.AllocRequest(keys=[K2, K2]), C.INVALID_ARGUMENT,
     "keys must be unique in one call"),
    ("alloc-existing-key-in-batch", "Alloc", pb.AllocRequest(keys=[K2, K0]), C.ALREADY_EXISTS,
     "already has an object"),
    ("alloc-unknown-pool-hint", "Alloc", pb.AllocRequest(keys=[K2], pool_hint="nope"), C.NOT_FOUND,
     "pool 'nope' is not registered"),
    ("alloc-require-hint-without-hint", "Alloc", pb.AllocRequest(keys=[K2], require_hint=True), C.INVALID_ARGUMENT,
     "require_hint needs a pool_hint"),
    ("alloc-more-than-the-pool", "Alloc",
     pb.AllocRequest(keys=[bytes([i]) * 4 for i in range(1, 9)], pool_hint="p0", require_hint=True),
     C.RESOURCE_EXHAUSTED, "pool 'p0': host pool full"),
    ("alloc-dry-run-too-many", "Alloc",
     pb.AllocRequest(keys=[bytes([i]) * 4 for i in range(1, 9)], pool_hint="p0", require_hint=True, dry_run=True),
     C.RESOURCE_EXHAUSTED, "pool 'p0': host pool full"),
    # -- lookups, writes, removal of unknown or invalid keys --
    ("lookup-unknown-key", "Lookup", pb.LookupRequest(keys=[K0, K2]), C.NOT_FOUND, f"no object for key {K2!r}"),
    ("lookup-empty-key", "Lookup", pb.LookupRequest(keys=[b""]), C.INVALID_ARGUMENT, "keys[0] must be bytes"),
    ("exists-oversized-key", "Exists", pb.ExistsRequest(keys=[b"y" * 600]), C.INVALID_ARGUMENT,
     "keys[0] must be bytes"),
    ("mark-unknown-key-in-batch", "MarkWritten", pb.MarkWrittenRequest(keys=[K1, K2], plane=1), C.NOT_FOUND,
     f"no object for key {K2!r}"),
    ("mark-plane-out-of-range", "MarkWritten", pb.MarkWrittenRequest(keys=[K1], plane=2), C.INVALID_ARGUMENT,
     "plane must be an int in [0, 2), got 2"),
    ("mark-plane-max", "MarkWritten", pb.MarkWrittenRequest(keys=[K1], plane=U32_MAX), C.INVALID_ARGUMENT,
     f"plane must be an int in [0, 2), got {U32_MAX}"),
    ("mark-duplicate-keys", "MarkWritten", pb.MarkWrittenRequest(keys=[K1, K1], plane=1), C.INVALID_ARGUMENT,
     "keys must be unique in one call"),
    ("remove-leased-object", "Remove", pb.RemoveRequest(keys=[K1, K0]), C.FAILED_PRECONDITION, ""),
    ("remove-empty-key", "Remove", pb.RemoveRequest(keys=[K1, b""]), C.INVALID_ARGUMENT, "keys[1] must be bytes"),
    # -- leases --
    ("lease-unknown-key", "Lease", pb.LeaseRequest(keys=[K0, K2]), C.NOT_FOUND, f"no object for key {K2!r}"),
    ("lease-ttl-over-a-day", "Lease", pb.LeaseRequest(keys=[K0], ttl_ms=86_400_001), C.INVALID_ARGUMENT,
     "ttl_ms must be <= 86400000 (a day), got 86400001"),
    ("lease-ttl-max", "Lease", pb.LeaseRequest(keys=[K0], ttl_ms=U64_MAX), C.INVALID_ARGUMENT, "ttl_ms must be <="),
    ("lease-duplicate-keys", "Lease", pb.LeaseRequest(keys=[K0, K0]), C.INVALID_ARGUMENT,
     "keys must be unique in one call"),
    ("renew-unknown-lease", "RenewLease", pb.RenewLeaseRequest(lease_id=987654), C.NOT_FOUND,
     "lease 987654 is not live"),
    ("renew-lease-zero", "RenewLease", pb.RenewLeaseRequest(lease_id=0), C.NOT_FOUND, "lease 0 is not live"),
    ("renew-max-lease-id", "RenewLease", pb.RenewLeaseRequest(lease_id=U64_MAX), C.NOT_FOUND, "is not live"),
]
# fmt: on


@pytest.mark.parametrize("name, method, message, code, text", REJECTED, ids=[r[0] for r in REJECTED])
def test_hostile_message_is_rejected_and_changes_nothing(stub, channel, name, method, message, code, text):
    before = snapshot(stub, channel)
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(message, timeout=5)
    assert info.value.code() == code, info.value.details()
    assert text in info.value.details()
    assert snapshot(stub, channel) == before


def test_renewing_a_live_lease_beyond_a_day_changes_nothing(stub, channel):
    before = snapshot(stub, channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.RenewLease(pb.RenewLeaseRequest(lease_id=stub.lease_id, ttl_ms=86_400_001), timeout=5)
    assert info.value.code() == C.INVALID_ARGUMENT
    assert snapshot(stub, channel) == before


# (id, method, request, the explicit "nothing done" reply the proto defines)
NO_OPS = [
    (
        "deregister-unknown-pool",
        "DeregisterPool",
        pb.DeregisterPoolRequest(pool_id="nope"),
        pb.DeregisterPoolReply(deregistered=False),
    ),
    (
        "release-unknown-lease",
        "ReleaseLease",
        pb.ReleaseLeaseRequest(lease_id=987654),
        pb.ReleaseLeaseReply(released=False),
    ),
    ("release-lease-zero", "ReleaseLease", pb.ReleaseLeaseRequest(lease_id=0), pb.ReleaseLeaseReply(released=False)),
    ("remove-unknown-keys", "Remove", pb.RemoveRequest(keys=[K2, b"zz"]), pb.RemoveReply(removed=0)),
    ("exists-unknown-keys", "Exists", pb.ExistsRequest(keys=[K2, K1]), pb.ExistsReply(exists=[False, False])),
    ("lookup-no-keys", "Lookup", pb.LookupRequest(keys=[]), pb.LookupReply()),
]


@pytest.mark.parametrize("name, method, message, reply", NO_OPS, ids=[r[0] for r in NO_OPS])
def test_unknown_names_get_the_explicit_nothing_done_reply(stub, channel, name, method, message, reply):
    before = snapshot(stub, channel)
    assert getattr(stub, method)(message, timeout=5) == reply
    assert snapshot(stub, channel) == before


def test_register_beyond_world_size_is_refused_and_changes_nothing(stub, channel):
    stub.RegisterPool(pb.RegisterPoolRequest(pool_id="p2", segment_name="seg-p2", geometry=GEOMETRY), timeout=5)
    before = snapshot(stub, channel)
    for pool_id in ("p3", "p4"):
        with pytest.raises(grpc.RpcError) as info:
            stub.RegisterPool(
                pb.RegisterPoolRequest(pool_id=pool_id, segment_name=f"seg-{pool_id}", geometry=GEOMETRY), timeout=5
            )
        assert info.value.code() == C.FAILED_PRECONDITION
        assert (
            f"cannot register pool {pool_id!r}: world_size=3 pools are registered (p0, p1, p2)" in info.value.details()
        )
    assert snapshot(stub, channel) == before
    # replace=true of a live id is not a way around world_size either: it is refused for unknown ids
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterPool(
            pb.RegisterPoolRequest(pool_id="p5", segment_name="seg-p5", geometry=GEOMETRY, replace=True), timeout=5
        )
    assert info.value.code() == C.FAILED_PRECONDITION
    assert snapshot(stub, channel) == before


@pytest.mark.parametrize(
    "method, payload, reply",
    [
        ("Alloc", b"\xff\xff\xff\xff\x0f\x0a", pb.AllocReply),  # not a protobuf message at all
        ("Lookup", b"\x0a\xff\xff\xff\xff\x0f", pb.LookupReply),  # a key longer than the message
        ("RegisterPool", b"\x0a\x02p2\x1a\x04\x08\x04\x10", pb.RegisterPoolReply),  # truncated geometry
    ],
    ids=["garbage", "length-past-the-end", "truncated-geometry"],
)
def test_undecodable_bytes_are_rejected_and_change_nothing(stub, channel, method, payload, reply):
    before = snapshot(stub, channel)
    with pytest.raises(grpc.RpcError) as info:
        raw(channel, method, reply)(payload, timeout=5)
    assert info.value.code() != C.OK
    assert snapshot(stub, channel) == before


def test_a_negative_plane_is_read_as_out_of_range(stub, channel):
    """-1 written as int64 by a hostile sender arrives as the largest uint32: refused by range."""
    payload = b"\x0a" + bytes([len(K1)]) + K1 + b"\x10" + NEGATIVE_ONE
    before = snapshot(stub, channel)
    with pytest.raises(grpc.RpcError) as info:
        raw(channel, "MarkWritten", pb.MarkWrittenReply)(payload, timeout=5)
    assert info.value.code() == C.INVALID_ARGUMENT
    assert f"got {U32_MAX}" in info.value.details()
    assert snapshot(stub, channel) == before


def test_negative_sizes_are_read_as_huge_and_refused(stub, channel):
    """num_blocks -1 (int64 varint) is 2**64-1 as uint64: the pool would overflow every byte total."""
    geometry = b"\x08\x04" + b"\x12\x01\x08" + b"\x18" + NEGATIVE_ONE  # block_size 4, rows [8], num_blocks -1
    payload = b"\x0a\x02p2" + b"\x12\x06seg-p2" + b"\x1a" + bytes([len(geometry)]) + geometry
    assert pb.RegisterPoolRequest.FromString(payload).geometry.num_blocks == U64_MAX
    before = snapshot(stub, channel)
    with pytest.raises(grpc.RpcError) as info:
        raw(channel, "RegisterPool", pb.RegisterPoolReply)(payload, timeout=5)
    assert info.value.code() == C.INVALID_ARGUMENT
    assert "is more than a pool may hold" in info.value.details()
    assert snapshot(stub, channel) == before
    assert stub.Stats(pb.MetaStatsRequest(), timeout=5).capacity_bytes == 2 * 4 * 4 * 16  # Stats still answers
