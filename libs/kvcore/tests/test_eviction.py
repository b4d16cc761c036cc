import uuid

import pytest
import torch

from kvcore.hostpool import LocalHostPool, PoolFullError
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
