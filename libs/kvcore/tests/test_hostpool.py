"""LocalHostPool beyond the backend contract (tests/integration/test_backend_contract.py runs that on
every backend): the hook map, shared-memory visibility, waits on in-flight copies, its own segment."""

import os
import re
import threading
import time

import pytest
import torch
from pool_support import _block, _fill, _keys, make_pool  # noqa: F401  (make_pool: fixture)

import kvcore.pool.host_pool as hp
from kvcore.pool.host_pool import HostPoolBackend
from kvcore.pool.local import LocalHostPool
from kvcore.pool.segment import SharedSegment

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


# ---- copies and lifecycle ----------------------------------------------------------------------------


def test_remove_waits_for_in_flight_copy(make_pool, monkeypatch):
    import kvcore.pool.local

    pool = make_pool(2)
    pool.alloc(_keys("a"))
    started, finish = threading.Event(), threading.Event()
    copy = kvcore.pool.local.scatter_blocks

    def slow_copy(*a):  # one slow copy of the put's blocks
        started.set()
        finish.wait(5)
        return copy(*a)

    monkeypatch.setattr(kvcore.pool.local, "scatter_blocks", slow_copy)
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


def test_constructor_checks_its_arguments(make_pool):
    pool = make_pool()
    with pytest.raises(ValueError, match="EvictionPolicy"):
        LocalHostPool(pool.segment, eviction="lru")
    with pytest.raises(ValueError, match="io_wait_timeout_s"):
        LocalHostPool(pool.segment, io_wait_timeout_s=0)
    with pytest.raises(ValueError, match="open SharedSegment"):
        LocalHostPool("segment")


def test_close_unlinks_the_segment_it_created_only(make_pool):
    pool = make_pool()
    path = pool.segment.path
    attached = SharedSegment.attach(pool.segment.name)
    LocalHostPool(attached).close()  # served a segment it does not own: leaves it
    assert os.path.exists(path) and not attached.closed
    attached.close()
    pool.close()
    assert not os.path.exists(path)
