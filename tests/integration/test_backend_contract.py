"""The contract every ``kvcore.pool.host_pool.HostPoolBackend`` must keep, run on each backend.

Each test takes ``make_pool(num_blocks)`` -> an empty pool of ``geometry(num_blocks)`` (two planes:
16 and 8 bytes per token row, 4 tokens per block) whose eviction policy is LRU, and must pass for
every entry of ``BACKENDS`` (``pool_contract_backends``; the data the tests write is
``pool_contract_data``, both in tests/integration/support). A new backend plugs in by adding a factory
there; its own quirks (segments, metastore membership, ...) are tested beside it, not here.

Rules this suite fixes for every backend (the hook map in ``kvcore.pool.host_pool`` states them):
batches are all-or-nothing; ``exists`` is true only for complete objects; written planes are
write-once (the same bytes again are a no-op, other bytes raise ``PlaneWritten``); a lease
protects its objects from removal and eviction until released or expired, and every lease handle
satisfies the ``kvcore.pool.leases.Lease`` protocol; eviction takes the least recently used complete,
unleased object.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from pool_contract_backends import BACKENDS, stop_mooncake
from pool_contract_data import BS, ROWS, block, fill, geometry, keys, read

from kvcore.pool.host_pool import (
    HostPoolBackend,
    IncompleteObject,
    LeaseExpired,
    ObjectExists,
    ObjectLeased,
    ObjectNotFound,
    PlaneWritten,
    PoolError,
    PoolFullError,
)
from kvcore.pool.leases import Lease


@pytest.fixture(scope="module", autouse=True)
def _stop_mooncake():
    yield
    stop_mooncake()


@pytest.fixture(params=sorted(BACKENDS))
def make_pool(request):
    ctx: dict = {}
    made: list[HostPoolBackend] = []

    def make(num_blocks: int = 6) -> HostPoolBackend:
        pool = BACKENDS[request.param](num_blocks, ctx)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()
    if "metastore" in ctx:
        ctx["metastore"].shutdown(grace_s=0)


# ---- objects ---------------------------------------------------------------------------------------


def test_round_trip_per_plane_any_dtype(make_pool):
    pool = make_pool()
    assert isinstance(pool, HostPoolBackend) and pool.geometry == geometry(6)
    k = keys("x", "y", "z")
    ids = pool.alloc(k)
    assert len(set(ids)) == 3 and pool.block_ids(k) == ids
    src0 = torch.randn(3, BS, 4)  # float32: 16 bytes per row
    src1 = torch.randn(3, BS, 4, dtype=torch.bfloat16)  # 8 bytes per row
    pool.put_from(k, 0, src0)
    pool.put_from(k, 1, src1)
    dst0 = torch.empty_like(src0)
    pool.get_into(k[::-1], 0, dst0)
    assert torch.equal(dst0, src0.flip(0))
    dst1 = torch.empty(3, BS, 2, 4, dtype=torch.uint8)  # trailing dims are fine if the bytes match
    pool.get_into(k, 1, dst1)
    assert torch.equal(dst1.view(3, BS, 8), src1.view(torch.uint8).view(3, BS, 8))
    assert torch.equal(pool.plane(0)[torch.tensor(ids)], src0.view(torch.uint8).view(3, BS, 16))
    assert torch.equal(read(pool, [k[1], k[1]], 0), src0[[1, 1]].view(torch.uint8).view(2, BS, 16))  # repeats


def test_exists_only_after_all_planes_and_written_planes_read_back(make_pool):
    pool = make_pool()
    k = keys("a", "b")
    pool.alloc(k)
    assert pool.exists(k + keys("zz")) == [False, False, False]
    pool.put_from(k[:1], 0, block(0, 0))
    assert pool.exists(k) == [False, False]
    with pytest.raises(IncompleteObject) as e:  # plane 1 is not written yet
        read(pool, k[:1], 1)
    assert e.value.key == b"a"
    assert torch.equal(read(pool, k[:1], 0), block(0, 0))  # a written plane reads back before completion
    pool.put_from(k[:1], 1, block(0, 1))
    assert pool.exists(k) == [True, False]
    assert pool.stats().complete_objects == 1


def test_written_planes_are_write_once(make_pool):
    pool = make_pool()
    k = keys("a", "b")
    fill(pool, k, seed=1)
    pool.put_from(k, 0, block(1, 0, 2))  # the same bytes again: a no-op
    with pytest.raises(PlaneWritten) as e:
        pool.put_from(k, 1, torch.cat([block(1, 1, 1), block(2, 1, 1)]))  # "b" differs
    assert e.value.key == b"b" and isinstance(e.value, PoolError)
    assert torch.equal(read(pool, k, 1), block(1, 1, 2)) and pool.exists(k) == [True, True]
    pool.alloc(keys("c"))
    pool.put_from(keys("c", "a"), 0, torch.cat([block(3, 0), block(1, 0, 2)[:1]]))  # fresh + same: fine
    with pytest.raises(PlaneWritten):
        pool.put_from(keys("c", "a"), 1, torch.cat([block(3, 1), block(9, 1)]))  # all-or-nothing
    assert pool.exists(keys("c")) == [False]
    with pytest.raises(IncompleteObject):
        read(pool, keys("c"), 1)


def test_several_planes_at_once_are_put_from_per_plane(make_pool):
    """``put_planes_from`` (a layer's main KV and indexer keys in one call) writes what one
    ``put_from`` per plane writes: both planes read back, the objects complete, the same bytes again
    a no-op, other bytes ``PlaneWritten``."""
    pool = make_pool()
    k = keys("a", "b")
    pool.alloc(k)
    pool.put_planes_from(k, {1: block(4, 1, 2), 0: block(4, 0, 2)})
    assert pool.exists(k) == [True, True] and pool.stats().complete_objects == 2
    assert torch.equal(read(pool, k, 0), block(4, 0, 2)) and torch.equal(read(pool, k, 1), block(4, 1, 2))
    pool.put_planes_from(k, {0: block(4, 0, 2), 1: block(4, 1, 2)})  # the same bytes: a no-op
    with pytest.raises(PlaneWritten) as e:
        pool.put_planes_from(k, {0: block(4, 0, 2), 1: block(5, 1, 2)})
    assert e.value.key == b"a" and torch.equal(read(pool, k, 1), block(4, 1, 2))
    pool.alloc(keys("c"))
    pool.put_planes_from(keys("c"), {0: block(6, 0)})  # one plane: put_from
    assert pool.exists(keys("c")) == [False] and torch.equal(read(pool, keys("c"), 0), block(6, 0))


def test_missing_keys_raise_not_found_with_the_key(make_pool):
    pool = make_pool()
    pool.alloc(keys("a"))
    for call in (
        lambda: pool.block_ids(keys("a", "q")),
        lambda: pool.put_from(keys("q"), 0, block(0, 0)),
        lambda: pool.get_into(keys("q"), 0, torch.empty(1, BS, 16, dtype=torch.uint8)),
        lambda: pool.lease(keys("q"), 100),
    ):
        with pytest.raises(ObjectNotFound) as e:
            call()
        assert e.value.key == b"q" and isinstance(e.value, PoolError)


def test_pool_full_with_numbers_and_all_or_nothing(make_pool):
    pool = make_pool(4)
    pool.alloc(keys("a", "b", "c"))  # incomplete objects are never evicted
    assert pool.can_alloc(keys("d")) and not pool.can_alloc(keys("d", "e"))
    with pytest.raises(PoolFullError) as e:
        pool.alloc(keys("d", "e"))
    err = e.value
    assert (err.needed, err.free, err.evictable, err.key) == (2, 1, 0, b"e")
    assert "2 block(s) needed, 1 free + 0 evictable of 4" in str(err)
    assert pool.stats().used_blocks == 3 and pool.exists(keys("d")) == [False]
    with pytest.raises(ObjectExists) as e2:
        pool.alloc(keys("d", "a"))
    assert e2.value.key == b"a" and pool.stats().used_blocks == 3  # "d" was not allocated either
    assert not pool.can_alloc(keys("a"))
    assert len(pool.alloc(keys("d"))) == 1 and pool.stats().free_blocks == 0


def test_remove_frees_complete_and_incomplete_objects_and_ignores_missing_keys(make_pool):
    pool = make_pool(3)
    fill(pool, keys("a"))
    pool.alloc(keys("w"))
    pool.remove(keys("a", "w", "missing"))
    pool.remove(keys("a"))  # idempotent
    assert pool.stats().used_blocks == 0 and pool.exists(keys("a")) == [False]
    pool.alloc(keys("a"))
    assert pool.exists(keys("a")) == [False]  # a re-allocated object starts unwritten
    pool.put_from(keys("a"), 0, block(5, 0))  # and its planes are writable again
    assert torch.equal(read(pool, keys("a"), 0), block(5, 0))


def test_stats_account_bytes(make_pool):
    pool = make_pool(6)
    g = pool.geometry
    s = pool.stats()
    assert (s.num_blocks, s.used_blocks, s.free_blocks, s.used_bytes, s.live_leases) == (6, 0, 6, 0, 0)
    assert s.capacity_bytes == 6 * BS * sum(ROWS) == g.total_bytes
    fill(pool, keys("a", "b"))
    pool.alloc(keys("c"))
    s = pool.stats()
    assert (s.used_blocks, s.free_blocks, s.used_bytes, s.complete_objects) == (3, 3, 3 * g.block_bytes, 2)


@pytest.mark.parametrize(
    "src, match",
    [
        (torch.zeros(2, BS, 16, dtype=torch.uint8), r"\[1, 4, 16 bytes per row\]"),
        (torch.zeros(1, BS, 8, dtype=torch.uint8), "got shape"),
        (torch.zeros(1, BS, 32, dtype=torch.uint8)[:, :, ::2], "contiguous"),
        ("not a tensor", "torch.Tensor"),
        (torch.zeros(1, BS, 16, dtype=torch.uint8, device="meta"), "CPU"),
    ],
)
def test_bad_tensors_are_value_errors(make_pool, src, match):
    pool = make_pool()
    pool.alloc(keys("a"))
    with pytest.raises(ValueError, match=match):
        pool.put_from(keys("a"), 0, src)
    with pytest.raises(ValueError, match=match):
        pool.get_into(keys("a"), 0, src)


def test_bad_keys_and_arguments_are_value_errors(make_pool):
    pool = make_pool()
    for bad, match in (
        (b"abc", "list of bytes"),
        (["a"], r"keys\[0\]"),
        ([b""], r"keys\[0\]"),
        ([b"x" * 600], r"keys\[0\]"),
        ([b"a", b"a"], "unique"),
    ):
        with pytest.raises(ValueError, match=match):
            pool.alloc(bad)
    fill(pool, keys("a"))
    with pytest.raises(ValueError, match="plane"):
        pool.put_from(keys("a"), 2, block(0, 0))
    with pytest.raises(ValueError, match="ttl_ms"):
        pool.lease(keys("a"), 0)
    with pool.lease(keys("a"), 1000) as lease, pytest.raises(ValueError, match="ttl_ms"):
        lease.renew(-1)


def test_empty_batches_are_no_ops(make_pool):
    pool = make_pool()
    assert pool.alloc([]) == [] and pool.exists([]) == [] and pool.block_ids([]) == []
    pool.put_from([], 0, torch.empty(0, BS, 16, dtype=torch.uint8))
    pool.get_into([], 1, torch.empty(0, BS, 8, dtype=torch.uint8))
    pool.remove([])
    assert pool.can_alloc([]) and pool.stats().used_blocks == 0


def test_close_is_idempotent_and_refuses_later_calls(make_pool):
    pool = make_pool()
    pool.close()
    pool.close()
    with pytest.raises(PoolError, match="closed"):
        pool.alloc(keys("a"))
    with pytest.raises(PoolError, match="closed"):
        pool.plane(0)


# ---- leases ----------------------------------------------------------------------------------------


def test_a_lease_protects_until_released_and_release_is_idempotent(make_pool):
    pool = make_pool(3)
    fill(pool, keys("a", "b"))
    lease = pool.lease(keys("a"), 10_000)
    assert isinstance(lease, Lease)
    assert lease.live and lease.keys == (b"a",) and lease.deadline > time.monotonic()
    with pytest.raises(ObjectLeased) as e:
        pool.remove(keys("b", "a"))
    assert e.value.key == b"a" and pool.exists(keys("a", "b")) == [True, True]  # all-or-nothing
    assert pool.stats().live_leases == 1
    with pool.lease(keys("a"), 10_000) as second:
        lease.release()
        lease.release()
        assert not lease.live and second.live
        with pytest.raises(ObjectLeased):
            pool.remove(keys("a"))  # the second lease still protects
    assert not second.live and pool.stats().live_leases == 0
    pool.remove(keys("a"))


def test_a_lease_expires_at_its_deadline_and_cannot_be_renewed_after(make_pool):
    pool = make_pool(2)
    fill(pool, keys("a"))
    lease = pool.lease(keys("a"), 10_000)
    before = lease.deadline
    assert lease.renew(20_000) > before
    lease.renew(50)
    time.sleep(0.15)
    assert not lease.live and pool.stats().live_leases == 0
    with pytest.raises(LeaseExpired):
        lease.renew(1000)
    lease.release()  # idempotent after expiry
    pool.remove(keys("a"))  # no longer protected


def test_a_writer_lease_pins_an_incomplete_object_while_it_fills_it(make_pool):
    pool = make_pool(3)
    pool.alloc(keys("w"))
    with pool.lease(keys("w"), 10_000):
        pool.put_from(keys("w"), 0, block(2, 0))  # unwritten planes of a leased object may be written
        pool.put_from(keys("w"), 1, block(2, 1))
        with pytest.raises(ObjectLeased):
            pool.remove(keys("w"))
        assert pool.exists(keys("w")) == [True]
    pool.remove(keys("w"))


# ---- LRU eviction ------------------------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_complete_unleased_object(make_pool):
    pool = make_pool(4)
    fill(pool, keys("a", "b", "c"))
    pool.alloc(keys("w"))  # incomplete: never evicted
    read(pool, keys("a"), 0)  # a is now the most recent
    assert pool.exists(keys("b")) == [True]  # a probe is not a use
    pool.alloc(keys("n1"))
    assert pool.exists(keys("a", "b", "c")) == [True, False, True]
    lease = pool.lease(keys("c"), 10_000)
    pool.alloc(keys("n2"))  # c is leased, so a goes
    assert pool.exists(keys("a", "c")) == [False, True]
    assert pool.stats().evictions == 2
    with pytest.raises(PoolFullError) as e:
        pool.alloc(keys("n3"))  # left: c leased, w + n1 + n2 incomplete
    assert (e.value.free, e.value.evictable) == (0, 0)
    lease.release()
    assert pool.can_alloc(keys("n3"))
    pool.alloc(keys("n3"))
    assert pool.exists(keys("c")) == [False]


def test_eviction_needs_enough_victims_or_evicts_nothing(make_pool):
    pool = make_pool(3)
    fill(pool, keys("a"))
    pool.alloc(keys("w"))
    with pytest.raises(PoolFullError) as e:
        pool.alloc(keys("x", "y", "z"))
    assert (e.value.free, e.value.evictable, e.value.key) == (1, 1, b"z")
    assert pool.exists(keys("a")) == [True] and pool.stats().evictions == 0


# ---- threads -----------------------------------------------------------------------------------------


def test_concurrent_writers_and_readers(make_pool):
    pool = make_pool(64)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(10):
                k = [f"{w}-{i}-{j}".encode() for j in range(3)]
                fill(pool, k, seed=w)
                with pool.lease(k, 10_000):
                    assert torch.equal(read(pool, k, 0), block(w, 0, 3))
                pool.remove(k)
        except BaseException as e:  # noqa: BLE001 - any failure of a worker, asserts too, is asserted empty below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and errors == [] and pool.stats().used_blocks == 0
