"""MetaStoreCore without gRPC: registry, index, allocation, leases, heartbeats, eviction, stats."""

import inspect
import re

import pytest

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import LeaseExpired, ObjectExists, ObjectLeased, ObjectNotFound, PoolFullError
from kvoffload_metastore import core as core_module
from kvoffload_metastore.core import MetaStoreCore
from kvoffload_metastore.errors import PoolFull
from kvoffload_metastore.leasebook import MAX_LEASE_TTL_MS
from poolbackends.errors import NoPoolRegistered, PoolConflict, PoolNotRegistered, WorldSizeExceeded

K = [bytes([i]) * 16 for i in range(1, 20)]


def geometry(num_blocks: int = 4, planes: int = 2) -> PoolGeometry:
    return PoolGeometry(block_size=4, plane_row_bytes=(8,) * planes, num_blocks=num_blocks)


def make(clock, **kw) -> MetaStoreCore:
    kw.setdefault("world_size", 2)
    kw.setdefault("lease_ttl_ms", 1000)
    kw.setdefault("heartbeat_timeout_ms", 5000)
    return MetaStoreCore(clock=clock, **kw)


def complete(core, keys, planes=2):
    for p in range(planes):
        core.mark_written(keys, p)


# ---- registry -------------------------------------------------------------------------------------


def test_world_size_refuses_one_more_pool_with_a_message(clock):
    core = make(clock, world_size=2)
    core.register_pool("a", "seg-a", geometry())
    core.register_pool("b", "seg-b", geometry())
    with pytest.raises(WorldSizeExceeded, match=r"world_size=2 pools are registered \(a, b\).*world_size"):
        core.register_pool("c", "seg-c", geometry())
    core.register_pool("a", "seg-a", geometry())  # idempotent re-registration is not a new pool
    core.deregister_pool("b")
    core.register_pool("c", "seg-c", geometry())


def test_register_conflict_and_replace(clock):
    core = make(clock)
    core.register_pool("a", "seg-a", geometry())
    core.alloc(K[:1], "a")
    with pytest.raises(PoolConflict, match="seg-a"):
        core.register_pool("a", "seg-other", geometry())
    core.register_pool("a", "seg-other", geometry(), replace=True)  # a restarted LocalService
    assert core.exists(K[:1]) == [False] and core.stats().pools[0].used_blocks == 0


@pytest.mark.parametrize(
    "args, match",
    [
        (("", "seg", geometry()), "pool_id"),
        (("a", "bad/name", geometry()), "segment name"),
        (("a", "seg", "geometry"), "geometry must be a PoolGeometry"),
    ],
)
def test_register_rejects_bad_input(args, match, clock):
    with pytest.raises(ValueError, match=match):
        make(clock).register_pool(*args)


def test_heartbeat_expiry_drops_a_dead_pools_objects_and_leases(clock):
    core = make(clock)
    core.register_pool("dead", "seg-d", geometry())
    core.register_pool("alive", "seg-a", geometry())
    core.alloc(K[:2], "dead")
    core.alloc(K[2:3], "alive")
    complete(core, K[:3])
    dead_lease = core.lease(K[:1], ttl_ms=60_000)
    alive_lease = core.lease(K[2:3], ttl_ms=60_000)
    clock.advance_ms(4000)
    assert core.heartbeat("alive") == 5000
    clock.advance_ms(999)
    assert core.exists(K[:3]) == [True, True, True]  # 4999 ms without a beat: still alive
    clock.advance_ms(1)
    assert core.exists(K[:3]) == [False, False, True]
    s = core.stats()
    assert [p.pool.pool_id for p in s.pools] == ["alive"]
    assert (s.pools_expired, s.leases_dropped, s.live_leases) == (1, 1, 1)
    with pytest.raises(LeaseExpired, match=f"lease {dead_lease.lease_id}"):
        core.renew_lease(dead_lease.lease_id)
    assert core.release_lease(dead_lease.lease_id) is False
    assert core.release_lease(alive_lease.lease_id) is True
    with pytest.raises(PoolNotRegistered, match=r"'dead'.*expired .* 5000 ms without a heartbeat"):
        core.heartbeat("dead")
    core.register_pool("dead", "seg-d", geometry())  # it may come back
    assert core.heartbeat("dead") == 5000


def test_deregister_is_idempotent_and_counts_what_it_dropped(clock):
    core = make(clock)
    core.register_pool("a", "seg-a", geometry())
    core.alloc(K[:2], "a")
    complete(core, K[:2])
    core.lease(K[:2])
    assert core.deregister_pool("a") == (True, 2, 1)
    assert core.deregister_pool("a") == (False, 0, 0)
    assert core.stats().live_leases == 0


# ---- objects --------------------------------------------------------------------------------------


def test_several_planes_are_marked_in_one_call_all_or_nothing(clock):
    core = make(clock)
    core.register_pool("a", "seg-a", geometry(num_blocks=4))
    core.alloc(K[:2], "a")
    assert core.mark_written(K[:2], [1, 0]) == [True, True]
    core.alloc(K[2:3], "a")
    with pytest.raises(ValueError, match=r"plane must be an int in \[0, 2\), got 7"):
        core.mark_written(K[2:3], [0, 7])
    assert core.lookup(K[2:3])[0].written_planes == ()  # plane 0 was not marked either
    with pytest.raises(ValueError, match="no plane"):
        core.mark_written(K[2:3], [])


def test_alloc_lookup_exists_remove(clock):
    core = make(clock)
    core.register_pool("a", "seg-a", geometry(num_blocks=4))
    a = core.alloc(K[:3], "a")
    assert (a.pool.pool_id, a.block_ids, a.evicted) == ("a", [0, 1, 2], 0)
    assert core.exists(K[:3] + [K[9]]) == [False] * 4  # incomplete objects do not exist yet
    assert core.mark_written(K[:2], 0) == [False, False]
    assert core.mark_written(K[:2], 1) == [True, True]
    assert core.mark_written(K[:2], 1) == [True, True]  # idempotent
    assert core.exists([K[0], K[2], K[0]]) == [True, False, True]
    loc = core.lookup([K[2], K[0]])
    assert [(x.block_id, x.complete, x.written_planes) for x in loc] == [(2, False, ()), (0, True, (0, 1))]
    assert loc[0].size_bytes == geometry().block_bytes
    with pytest.raises(ObjectExists, match=re.escape(repr(K[1]))):
        core.alloc([K[5], K[1]], "a")
    with pytest.raises(ObjectNotFound, match=re.escape(repr(K[7]))):
        core.lookup([K[0], K[7]])
    assert core.remove([K[0], K[0], K[8]]) == 1  # duplicates and missing keys are fine
    assert core.remove([K[0]]) == 0
    assert core.alloc([K[4]], "a").block_ids == [0]  # freed blocks are reused first


def test_mark_written_validates_the_plane_per_pool(clock):
    core = make(clock)
    core.register_pool("a", "seg-a", geometry(planes=2))
    core.alloc(K[:1], "a")
    with pytest.raises(ValueError, match=r"pool 'a'.*plane must be an int in \[0, 2\)"):
        core.mark_written(K[:1], 2)
    with pytest.raises(ObjectNotFound):
        core.mark_written([K[1]], 0)


def test_alloc_placement_hint_fallback_and_errors(clock):
    core = make(clock)
    with pytest.raises(NoPoolRegistered, match="no pool is registered"):
        core.alloc(K[:1])
    core.register_pool("small", "seg-s", geometry(num_blocks=1))
    core.register_pool("big", "seg-b", geometry(num_blocks=4))
    assert core.alloc(K[:1]).pool.pool_id == "big"  # most free blocks first
    assert core.alloc(K[1:2], "small").pool.pool_id == "small"
    assert core.alloc(K[2:3], "small").pool.pool_id == "big"  # hint full: falls back
    with pytest.raises(PoolFull, match=r"pool 'small'.*1 block\(s\) needed, 0 free"):
        core.alloc(K[3:4], "small", require_hint=True)
    with pytest.raises(PoolNotRegistered, match="'nope'"):
        core.alloc(K[3:4], "nope")
    with pytest.raises(ValueError, match="unique"):
        core.alloc([K[5], K[5]])
    with pytest.raises(ValueError, match="require_hint needs a pool_hint"):
        core.alloc(K[5:6], require_hint=True)
    assert core.can_alloc(K[5:7]) and not core.can_alloc(K[5:9])
    assert core.check_alloc(K[5:7])[0].pool_id == "big"
    assert core.stats().objects == 3  # the checks changed nothing


def test_full_pool_error_carries_the_numbers_and_changes_nothing(clock):
    core = make(clock)
    core.register_pool("a", "seg-a", geometry(num_blocks=3))
    core.alloc(K[:2], "a")
    complete(core, K[:1])  # K[0] evictable, K[1] incomplete
    with pytest.raises(PoolFullError) as info:
        core.alloc(K[5:8], "a")
    e = info.value
    assert (e.needed, e.free, e.evictable, e.num_blocks, e.key) == (3, 1, 1, 3, K[7])
    assert "pool 'a'" in str(e) and repr(K[7]) in str(e)
    assert core.exists(K[:1]) == [True] and core.stats().evictions == 0


def test_lru_eviction_order_skips_leased_and_incomplete_objects(clock):
    core = make(clock)
    core.register_pool("a", "seg-a", geometry(num_blocks=4))
    core.alloc(K[:4], "a")
    complete(core, [K[2], K[0], K[1]])  # LRU order by completion: K2, K0, K1 (K3 stays incomplete)
    core.lease([K[0]])  # a lease is a use: order K2, K1, K0, and K0 is protected
    a = core.alloc([K[10]], "a")
    assert a.evicted == 1 and core.exists([K[2], K[1], K[0]]) == [False, True, True]
    a = core.alloc([K[11]], "a")
    assert a.evicted == 1 and core.exists([K[1], K[0]]) == [False, True]
    with pytest.raises(PoolFullError) as info:
        core.alloc([K[12]], "a")  # K[0] leased, K[3]/K[10]/K[11] incomplete: nothing evictable
    assert info.value.evictable == 0
    assert core.stats().evictions == 2 and core.stats().pools[0].evictions == 2


def test_lookup_and_exists_are_not_uses_for_lru(clock):
    core = make(clock)
    core.register_pool("a", "seg-a", geometry(num_blocks=2))
    core.alloc(K[:2], "a")
    complete(core, K[:2])
    core.lookup([K[0]])
    core.exists([K[0]])
    core.alloc([K[5]], "a")
    assert core.exists(K[:2]) == [False, True]


# ---- leases ---------------------------------------------------------------------------------------


def test_lease_ttl_expiry_on_the_injected_clock(clock):
    core = make(clock, lease_ttl_ms=1000)
    core.register_pool("a", "seg-a", geometry(num_blocks=2))
    core.alloc(K[:2], "a")
    complete(core, K[:2])
    g = core.lease(K[:1], holder="decode-0/req-1")
    assert g.ttl_ms == 1000 and g.deadline == clock.now + 1.0
    assert [loc.block_id for loc in g.locations] == [0]
    with pytest.raises(ObjectLeased, match=re.escape(repr(K[0]))):
        core.remove(K[:2])
    assert core.exists(K[:2]) == [True, True]  # nothing removed
    clock.advance_ms(600)
    assert core.renew_lease(g.lease_id, 1000)[0] == 1000  # now + 1 s
    clock.advance_ms(999)
    assert core.stats().live_leases == 1
    clock.advance_ms(1)
    s = core.stats()
    assert (s.live_leases, s.lease_expiries) == (0, 1)
    with pytest.raises(LeaseExpired):
        core.renew_lease(g.lease_id)
    assert core.remove(K[:1]) == 1


def test_lease_rules(clock):
    core = make(clock)
    core.register_pool("a", "seg-a", geometry(num_blocks=2))
    core.alloc(K[:1], "a")
    g = core.lease(K[:1], ttl_ms=5)  # incomplete objects may be leased (a writer pins them)
    assert g.ttl_ms == 5 and g.locations[0].complete is False
    with pytest.raises(ObjectNotFound):
        core.lease([K[0], K[3]])
    for bad in (-1, 1.5, True, MAX_LEASE_TTL_MS + 1):
        with pytest.raises(ValueError, match="ttl_ms"):
            core.lease(K[:1], ttl_ms=bad)
    assert core.release_lease(g.lease_id) is True
    assert core.release_lease(g.lease_id) is False  # idempotent
    assert core.release_lease(12345) is False
    with pytest.raises(LeaseExpired):
        core.renew_lease(g.lease_id)


def test_expired_lease_ids_do_not_accumulate(clock):
    core = make(clock, lease_ttl_ms=1)
    core.register_pool("a", "seg-a", geometry(num_blocks=1))
    core.alloc(K[:1], "a")
    for _ in range(500):
        core.lease(K[:1])
        clock.advance_ms(2)
    assert len(core._leases) <= 65


def test_shutdown_releases_everything(clock):
    core = make(clock)
    core.register_pool("a", "seg-a", geometry())
    core.alloc(K[:1], "a")
    core.lease(K[:1])
    assert core.shutdown() == (1, 1)
    s = core.stats()
    assert (len(s.pools), s.live_leases, s.objects) == (0, 0, 0)


def test_stats_occupancy(clock):
    core = make(clock, dram_bytes_per_local_service=10 * 2**30)
    core.register_pool("a", "seg-a", geometry(num_blocks=4))
    core.alloc(K[:3], "a")
    complete(core, K[:1])
    clock.advance_ms(250)
    s = core.stats()
    (p,) = s.pools
    assert (p.used_blocks, p.free_blocks, p.objects, p.complete_objects, p.heartbeat_age_ms) == (3, 1, 3, 1, 250)
    assert p.used_bytes == 3 * geometry().block_bytes and p.capacity_bytes == geometry(num_blocks=4).total_bytes
    assert (s.objects, s.complete_objects, s.dram_bytes_per_local_service) == (3, 1, 10 * 2**30)


def test_hook_map_names_every_public_method():
    """STYLE 9: the module docstring's hook map stays honest."""
    public = {n for n, m in inspect.getmembers(MetaStoreCore, inspect.isfunction) if not n.startswith("_")}
    mapped = set(re.findall(r"``(\w+)\(", core_module.__doc__))
    assert public <= mapped, f"hook map misses {sorted(public - mapped)}"
    assert mapped <= public, f"hook map names unknown hooks {sorted(mapped - public)}"
