import time

import pytest

from kvcore.eviction import LRUEviction
from kvcore.hostpool import LeaseExpired, ObjectLeased, ObjectNotFound

from pool_support import BS, ROWS, _block, _fill, _geometry, _keys, _name, make_pool  # noqa: F401  (make_pool: fixture)


# ---- leases, through the pool ----------------------------------------------------------------


def test_lease_blocks_remove_and_write_and_expires(make_pool):
    pool = make_pool(2, eviction=LRUEviction())
    _fill(pool, _keys("a", "b"))
    lease = pool.lease(_keys("a"), 10_000)
    assert lease.live and lease.keys == (b"a",) and lease.deadline > time.monotonic()
    with pytest.raises(ObjectLeased) as e:
        pool.remove(_keys("b", "a"))
    assert e.value.key == b"a" and pool.exists(_keys("a", "b")) == [True, True]  # all-or-nothing
    with pytest.raises(ObjectLeased):
        pool.put_from(_keys("a"), 0, _block(1, 0))
    assert pool.stats().live_leases == 1
    lease.renew(5)
    time.sleep(0.03)
    stats = pool.stats()
    assert (stats.live_leases, stats.lease_expiries) == (0, 1) and not lease.live
    with pytest.raises(LeaseExpired) as e3:
        lease.renew(1000)
    assert e3.value.key == b"a"
    lease.release()  # idempotent after expiry
    pool.remove(_keys("a"))
    assert pool.stats().lease_expiries == 1


def test_lease_pins_incomplete_objects_and_release_is_idempotent(make_pool):
    pool = make_pool(3, eviction=LRUEviction())
    _fill(pool, _keys("a"))
    pool.alloc(_keys("w"))
    with pytest.raises(ObjectNotFound):
        pool.lease(_keys("a", "zz"), 1000)
    assert pool.stats().live_leases == 0
    writer = pool.lease(_keys("w"), 1000)  # a writer pins the object it is filling
    pool.put_from(_keys("w"), 0, _block(2, 0))  # unwritten planes of a leased object may be written
    pool.put_from(_keys("w"), 1, _block(2, 1))
    with pytest.raises(ObjectLeased):
        pool.put_from(_keys("w"), 0, _block(3, 0))  # a written plane may not be rewritten
    with pytest.raises(ObjectLeased):
        pool.remove(_keys("w"))
    writer.release()
    pool.remove(_keys("w"))
    with pool.lease(_keys("a"), 1000) as l1, pool.lease(_keys("a"), 1000) as l2:
        l1.release()
        l1.release()
        with pytest.raises(ObjectLeased):
            pool.remove(_keys("a"))  # l2 still protects
        assert pool.stats().live_leases == 1
    assert not l2.live and pool.stats().lease_expiries == 0
    pool.remove(_keys("a"))
