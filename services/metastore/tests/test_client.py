"""MetaStoreClient against a real in-process server: kvcore-shaped hooks and kvcore's exception types,
plus the data path it leaves to shared memory (SharedSegment.attach)."""

import os

import grpc
import pytest
import torch

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import LeaseExpired, ObjectExists, ObjectLeased, ObjectNotFound, PoolFullError, PoolStats
from kvcore.pool.segment import SharedSegment
from poolbackends.client import MetaStoreClient
from poolbackends.errors import MetaStoreUnavailable, NoPoolRegistered, PoolNotRegistered, WorldSizeExceeded

K = [bytes([i]) * 16 for i in range(1, 12)]
GEOMETRY = PoolGeometry(block_size=4, plane_row_bytes=(8, 16), num_blocks=3)


@pytest.fixture
def client(running):
    with MetaStoreClient(running.target, pool_id="p0", timeout_s=5) as c:
        yield c


def test_hostpool_shaped_hooks_and_exceptions(client, running):
    with pytest.raises(NoPoolRegistered):
        client.alloc(K[:1])
    assert client.can_alloc(K[:1]) is False
    reply = client.register_pool("seg-p0", GEOMETRY, host="h")
    assert reply.heartbeat_interval_ms == 1666 and client.heartbeat() == 5000
    assert client.can_alloc(K[:3]) and not client.can_alloc(K[:4])
    assert client.alloc(K[:2]) == [0, 1]
    assert client.can_alloc(K[:1]) is False  # exists already
    with pytest.raises(ObjectExists) as info:
        client.alloc([K[5], K[1]])
    assert info.value.key == K[1]
    with pytest.raises(PoolFullError) as info:
        client.alloc(K[5:7])
    e = info.value
    assert (e.needed, e.free, e.evictable, e.key) == (2, 1, 0, K[6]) and "pool 'p0'" in str(e)
    assert client.mark_written(K[:1], 0) == [False] and client.mark_written(K[:1], 1) == [True]
    assert client.exists(K[:2]) == [True, False]
    assert client.block_ids([K[1], K[0]]) == [1, 0]
    with pytest.raises(ObjectNotFound) as info:
        client.block_ids([K[9]])
    assert info.value.key == K[9]
    with pytest.raises(ValueError, match="unique"):
        client.alloc([K[7], K[7]])
    with client.lease(K[:1], 60_000, holder="test") as lease:
        assert lease.live and lease.locations[0].block_id == 0
        with pytest.raises(ObjectLeased) as info:
            client.remove(K[:2])
        assert info.value.key == K[0]
        lease.renew(60_000)
    assert not lease.live
    with pytest.raises(LeaseExpired):
        lease.renew()
    stats = client.stats()
    assert isinstance(stats, PoolStats)
    assert (stats.num_blocks, stats.used_blocks, stats.free_blocks, stats.complete_objects) == (3, 2, 1, 1)
    assert stats.used_bytes == 2 * GEOMETRY.block_bytes and stats.live_leases == 0
    client.remove(K[:2])
    assert client.stats().used_blocks == 0
    assert client.deregister_pool() and not client.deregister_pool()
    with pytest.raises(PoolNotRegistered):
        client.heartbeat()


def test_registry_errors(running):
    with MetaStoreClient(running.target) as c:
        for i in range(2):
            c.register_pool(f"seg-{i}", GEOMETRY, pool_id=f"p{i}")
        with pytest.raises(WorldSizeExceeded, match="world_size=2"):
            c.register_pool("seg-2", GEOMETRY, pool_id="p2")
        with pytest.raises(ValueError, match="pool_id is required"):
            c.heartbeat()
        assert c.alloc_objects(K[:1]).pool.pool_id in ("p0", "p1")
        assert c.stats().num_blocks == 6  # all pools summed without a pool_id


def test_unreachable_metastore_is_unavailable_within_the_deadline():
    with MetaStoreClient("127.0.0.1:1", timeout_s=0.2) as c:
        with pytest.raises(MetaStoreUnavailable) as info:
            c.exists(K[:1])
    assert info.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_bytes_move_in_shared_memory_at_the_block_ids_it_hands_out(running):
    name = f"mstest-{os.getpid()}"
    with SharedSegment.create(name, GEOMETRY, replace=True) as owner:  # the LocalService's segment
        local = MetaStoreClient(running.target, pool_id="local")
        local.register_pool(name, GEOMETRY)
        writer = MetaStoreClient(running.target)
        ids = writer.alloc_objects(K[:2], "local", require_hint=True).block_ids
        seg = SharedSegment.attach(name)
        rows = torch.arange(2 * 4 * 8, dtype=torch.uint8).view(2, 4, 8)  # [n, block_size, row_bytes]
        seg.plane(0)[torch.tensor(ids)] = rows
        seg.plane(1)[torch.tensor(ids)] = 7
        writer.mark_written(K[:2], 0)
        assert writer.mark_written(K[:2], 1) == [True, True]
        with writer.lease(K[:2]) as lease:
            got = owner.plane(0)[torch.tensor([loc.block_id for loc in lease.locations])]
        assert torch.equal(got, rows)
        seg.close()
        for c in (local, writer):
            c.close()
