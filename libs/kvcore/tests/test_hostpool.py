import os
import re
import threading
import time

import pytest
import torch

import kvcore.hostpool as hp
from kvcore.eviction import NoEviction
from kvcore.hostpool import (
    HostPoolBackend,
    IncompleteObject,
    LocalHostPool,
    ObjectExists,
    ObjectNotFound,
    PoolError,
    PoolFullError,
)
from kvcore.segment import SharedSegment

from pool_support import BS, ROWS, _block, _fill, _geometry, _keys, _name, make_pool  # noqa: F401  (make_pool: fixture)


# ---- hook map --------------------------------------------------------------------------------


def test_hook_map_matches_abstract_methods():
    documented = re.findall(r"^``(\w+)(?:\([^)]*\))?``$", hp.__doc__, re.M)  # one entry per line
    assert len(documented) == len(set(documented))
    assert set(documented) == set(HostPoolBackend.__abstractmethods__)


# ---- shared segment --------------------------------------------------------------------------


def test_pool_blocks_visible_to_attached_segment(make_pool):
    pool = make_pool(4)
    k = _keys("a", "b")
    _fill(pool, k, seed=3)
    other = SharedSegment.attach(pool.segment.name)
    ids = torch.tensor(pool.block_ids(k))
    assert torch.equal(other.plane(1)[ids], _block(3, 1, 2))
    other.close()


# ---- object store ----------------------------------------------------------------------------


def test_round_trip_per_plane_any_dtype(make_pool):
    pool = make_pool()
    keys = _keys("x", "y", "z")
    ids = pool.alloc(keys)
    assert ids == [0, 1, 2] and pool.block_ids(keys) == ids
    src0 = torch.randn(3, BS, 4)  # float32: 16 bytes per row
    src1 = torch.randn(3, BS, 4, dtype=torch.bfloat16)  # 8 bytes per row
    pool.put_from(keys, 0, src0)
    pool.put_from(keys, 1, src1)
    dst0 = torch.empty_like(src0)
    pool.get_into(keys[::-1], 0, dst0)
    assert torch.equal(dst0, src0.flip(0))
    dst1 = torch.empty(3, BS, 2, 4, dtype=torch.uint8)  # trailing dims are fine if the bytes match
    pool.get_into(keys, 1, dst1)
    assert torch.equal(dst1.view(3, BS, 8), src1.view(torch.uint8).view(3, BS, 8))
    assert torch.equal(pool.plane(0)[torch.tensor(ids)], src0.view(torch.uint8).view(3, BS, 16))


def test_exists_only_after_all_planes(make_pool):
    pool = make_pool()
    k = _keys("a", "b")
    pool.alloc(k)
    assert pool.exists(k + _keys("zz")) == [False, False, False]
    pool.put_from(k[:1], 0, _block(0, 0))
    assert pool.exists(k) == [False, False]
    with pytest.raises(IncompleteObject) as e:  # plane 1 is not written yet
        pool.get_into(k[:1], 1, torch.empty(1, BS, 8, dtype=torch.uint8))
    assert e.value.key == b"a"
    back = torch.empty(1, BS, 16, dtype=torch.uint8)
    pool.get_into(k[:1], 0, back)  # a written plane reads back before the object is complete
    assert torch.equal(back, _block(0, 0).view(torch.uint8).view(1, BS, 16))
    pool.put_from(k[:1], 1, _block(0, 1))
    assert pool.exists(k) == [True, False]
    assert pool.stats().complete_objects == 1


def test_not_found_carries_key(make_pool):
    pool = make_pool()
    pool.alloc(_keys("a"))
    for call in (lambda: pool.block_ids(_keys("a", "q")),
                 lambda: pool.put_from(_keys("q"), 0, _block(0, 0)),
                 lambda: pool.get_into(_keys("q"), 0, torch.empty(1, BS, 16, dtype=torch.uint8)),
                 lambda: pool.lease(_keys("q"), 100)):
        with pytest.raises(ObjectNotFound) as e:
            call()
        assert e.value.key == b"q" and isinstance(e.value, PoolError)


def test_pool_full_with_numbers_and_all_or_nothing(make_pool):
    pool = make_pool(4, eviction=NoEviction())
    pool.alloc(_keys("a", "b", "c"))
    assert not pool.can_alloc(_keys("d", "e"))
    with pytest.raises(PoolFullError) as e:
        pool.alloc(_keys("d", "e"))
    err = e.value
    assert (err.needed, err.free, err.evictable, err.key) == (2, 1, 0, b"e")
    assert "2 block(s) needed, 1 free + 0 evictable of 4" in str(err)
    assert pool.stats().used_blocks == 3 and pool.exists(_keys("d")) == [False]
    with pytest.raises(ObjectExists) as e2:
        pool.alloc(_keys("d", "a"))
    assert e2.value.key == b"a" and pool.stats().used_blocks == 3  # "d" was not allocated either
    assert not pool.can_alloc(_keys("a"))
    assert pool.can_alloc(_keys("d")) and pool.alloc(_keys("d")) == [3]



def test_remove_semantics(make_pool):
    pool = make_pool(3)
    _fill(pool, _keys("a"))
    pool.alloc(_keys("w"))
    pool.remove(_keys("a", "w", "missing"))  # incomplete objects too; missing ignored
    pool.remove(_keys("a"))
    assert pool.stats().used_blocks == 0 and pool.exists(_keys("a")) == [False]
    pool.alloc(_keys("a"))
    assert pool.exists(_keys("a")) == [False]  # a re-allocated block starts unwritten


def test_rewrite_complete_object(make_pool):
    pool = make_pool(2)
    _fill(pool, _keys("a"), seed=1)
    pool.put_from(_keys("a"), 1, _block(2, 1))
    out = torch.empty(1, BS, 8, dtype=torch.uint8)
    pool.get_into(_keys("a"), 1, out)
    assert pool.exists(_keys("a")) == [True] and torch.equal(out, _block(2, 1))


def test_stats_byte_accounting(make_pool):
    pool = make_pool(6)
    s = pool.stats()
    assert (s.num_blocks, s.used_blocks, s.free_blocks, s.used_bytes) == (6, 0, 6, 0)
    assert s.capacity_bytes == 6 * BS * sum(ROWS) == pool.geometry.total_bytes
    _fill(pool, _keys("a", "b"))
    pool.alloc(_keys("c"))
    s = pool.stats()
    assert (s.used_blocks, s.free_blocks, s.used_bytes, s.complete_objects) == (3, 3, 3 * BS * 24, 2)
    assert s.used_bytes + s.free_blocks * pool.geometry.block_bytes == s.capacity_bytes


def test_remove_waits_for_in_flight_copy(make_pool):
    pool = make_pool(2)
    pool.alloc(_keys("a"))
    started, finish = threading.Event(), threading.Event()
    plane = pool.segment.plane(0)

    class SlowPlane:  # stands in for plane 0 during one slow copy
        def index_copy_(self, *a):
            started.set()
            finish.wait(5)
            return plane.index_copy_(*a)

    real = pool.segment.plane
    pool.segment.plane = lambda p: SlowPlane() if p == 0 else real(p)
    t = threading.Thread(target=pool.put_from, args=(_keys("a"), 0, _block(0, 0)))
    t.start()
    assert started.wait(5)
    removed = threading.Event()
    r = threading.Thread(target=lambda: (pool.remove(_keys("a")), removed.set()))
    r.start()
    time.sleep(0.05)
    assert not removed.is_set() and pool.alloc(_keys("b")) == [1]  # remove waits; others proceed
    finish.set()
    t.join(5)
    r.join(5)
    assert removed.is_set() and pool.stats().used_blocks == 1


def test_concurrent_writers_and_readers(make_pool):
    pool = make_pool(64)
    errors = []

    def worker(w: int) -> None:
        try:
            for i in range(20):
                k = [f"{w}-{i}-{j}".encode() for j in range(3)]
                _fill(pool, k, seed=w)
                out = torch.empty(3, BS, 16, dtype=torch.uint8)
                with pool.lease(k, 1000):
                    pool.get_into(k, 0, out)
                assert torch.equal(out, _block(w, 0, 3))
                pool.remove(k)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and pool.stats().used_blocks == 0


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
def test_put_from_bad_tensors(make_pool, src, match):
    pool = make_pool()
    pool.alloc(_keys("a"))
    with pytest.raises(ValueError, match=match):
        pool.put_from(_keys("a"), 0, src)


def test_bad_keys_and_args(make_pool):
    pool = make_pool()
    for keys, match in ((b"abc", "list of bytes"), (["a"], r"keys\[0\]"), ([b""], r"keys\[0\]"),
                        ([b"x" * 600], r"keys\[0\]"), ([b"a", b"a"], "unique")):
        with pytest.raises(ValueError, match=match):
            pool.alloc(keys)
    _fill(pool, _keys("a"))
    with pytest.raises(ValueError, match="plane"):
        pool.put_from(_keys("a"), 2, _block(0, 0))
    with pytest.raises(ValueError, match="ttl_ms"):
        pool.lease(_keys("a"), 0)
    with pytest.raises(ValueError, match="ttl_ms"):
        pool.lease(_keys("a"), 1000).renew(-1)
    with pytest.raises(ValueError, match="EvictionPolicy"):
        LocalHostPool(pool.segment, eviction="lru")


def test_close(make_pool):
    pool = make_pool()
    path = pool.segment.path
    pool.close()
    pool.close()
    assert not os.path.exists(path)
    with pytest.raises(PoolError, match="closed"):
        pool.alloc(_keys("a"))
    with pytest.raises(PoolError, match="closed"):
        pool.plane(0)


def test_empty_batches(make_pool):
    pool = make_pool()
    assert pool.alloc([]) == [] and pool.exists([]) == [] and pool.block_ids([]) == []
    pool.put_from([], 0, torch.empty(0, BS, 16, dtype=torch.uint8))
    pool.get_into([], 1, torch.empty(0, BS, 8, dtype=torch.uint8))
    pool.remove([])
    pool.lease([], 10).release()
    assert pool.can_alloc([]) and pool.stats().used_blocks == 0
