
import pytest
import torch

from kvcore.hostpool import PoolFullError

from pool_support import BS, ROWS, _block, _fill, _geometry, _keys, _name, make_pool  # noqa: F401  (make_pool: fixture)


# ---- LRU eviction (the default policy), through the pool -------------------------------------


def test_lru_eviction_order(make_pool):
    pool = make_pool(4)
    _fill(pool, _keys("a", "b", "c"))
    pool.alloc(_keys("w"))  # incomplete: never evicted
    pool.get_into(_keys("a"), 0, torch.empty(1, BS, 16, dtype=torch.uint8))  # a is now most recent
    assert pool.exists(_keys("b")) == [True]  # a probe is not a use
    pool.alloc(_keys("n1"))
    assert pool.exists(_keys("a", "b", "c")) == [True, False, True]
    lease = pool.lease(_keys("c"), 10_000)
    pool.alloc(_keys("n2"))  # c is leased, so a goes
    assert pool.exists(_keys("a", "c")) == [False, True]
    assert pool.stats().evictions == 2
    with pytest.raises(PoolFullError) as e:
        pool.alloc(_keys("n3"))  # left: c leased, w + n1 + n2 incomplete
    assert (e.value.free, e.value.evictable) == (0, 0)
    lease.release()
    assert pool.can_alloc(_keys("n3"))
    pool.alloc(_keys("n3"))
    assert pool.exists(_keys("c")) == [False] and pool.block_ids(_keys("w")) == [3]


def test_eviction_needs_enough_victims_or_evicts_nothing(make_pool):
    pool = make_pool(3)
    _fill(pool, _keys("a"))
    pool.alloc(_keys("w"))
    with pytest.raises(PoolFullError) as e:
        pool.alloc(_keys("x", "y", "z"))
    assert (e.value.free, e.value.evictable, e.value.key) == (1, 1, b"z")
    assert pool.exists(_keys("a")) == [True] and pool.stats().evictions == 0
