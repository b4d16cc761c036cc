import time
import uuid

import pytest
import torch

from kvcore.eviction import LRUEviction
from kvcore.hostpool import LeaseExpired, LocalHostPool, ObjectLeased, ObjectNotFound
from kvcore.segment import PoolGeometry

BS = 4
ROWS = (16, 8)  # plane 0: 16 bytes/token, plane 1: 8 bytes/token


def _name() -> str:
    return f"test-{uuid.uuid4().hex[:16]}"


def _geometry(num_blocks: int = 6) -> PoolGeometry:
    return PoolGeometry(BS, ROWS, num_blocks)


@pytest.fixture
def make_pool():
    pools = []

    def make(num_blocks: int = 6, eviction=None, **kw) -> LocalHostPool:
        pool = LocalHostPool.create(_name(), _geometry(num_blocks), eviction=eviction, **kw)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def _block(seed: int, plane: int, n: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + plane)
    return torch.randint(0, 256, (n, BS, ROWS[plane]), dtype=torch.uint8, generator=g)


def _fill(pool, keys, seed: int = 0) -> None:
    pool.alloc(keys)
    for p in range(len(ROWS)):
        pool.put_from(keys, p, _block(seed, p, len(keys)))


def _keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


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
