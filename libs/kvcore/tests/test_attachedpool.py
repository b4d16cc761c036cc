"""``AttachedPool``: a decode TP follower's view of rank 0's pool. Its allocations are the ids rank 0
handed over, in order and in count (anything else raises, never writes elsewhere); its planes are
rank 0's memory; it counts only what its requests reference and frees nothing of rank 0's."""

import uuid

import pytest
import torch

from kvcore.pool.attached import AttachedPool
from kvcore.pool.errors import PoolError
from kvcore.pool.eviction import NoEviction
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.local import LocalHostPool

BS, ROWS = 4, (8, 16)


@pytest.fixture
def pools():
    owner = LocalHostPool.create(
        f"test-attached-{uuid.uuid4().hex[:8]}", PoolGeometry(BS, ROWS, 8), eviction=NoEviction()
    )
    view = AttachedPool.attach(owner.segment.name)
    yield owner, view
    view.close()
    owner.close()


def test_the_view_takes_rank_0s_ids_and_writes_into_rank_0s_memory(pools):
    owner, view = pools
    keys = [b"r-0", b"r-1", b"r-2"]
    ids = owner.alloc(keys)
    view.give(ids)
    assert view.alloc(keys) == ids
    rows = torch.arange(BS * ROWS[1], dtype=torch.uint8).view(BS, ROWS[1])
    view.plane(1)[ids[2]] = rows
    assert torch.equal(owner.segment.plane(1)[ids[2]], rows)
    assert view.geometry == owner.geometry
    s = view.stats()
    assert (s.used_blocks, s.used_bytes, s.capacity_bytes) == (3, 3 * owner.geometry.block_bytes, 0)
    view.remove(keys[:2])
    assert view.stats().used_blocks == 1
    assert owner.stats().used_blocks == 3  # the view frees nothing of rank 0's


def test_a_view_out_of_step_with_rank_0_raises(pools):
    owner, view = pools
    with pytest.raises(PoolError, match="gave no block ids for the 2 blocks"):
        view.alloc([b"a", b"b"])
    view.give(owner.alloc([b"a"]))
    with pytest.raises(PoolError, match="gave 1 block ids for 2 blocks"):
        view.alloc([b"a", b"b"])
    view.give(owner.alloc([b"c"]))
    view.alloc([b"c"])
    view.give([5])
    with pytest.raises(PoolError, match="already hold blocks"):
        view.alloc([b"c"])
    with pytest.raises(PoolError, match="rank 0's pool does"):
        view.can_alloc([b"d"])


def test_allocations_are_taken_in_the_order_rank_0_made_them(pools):
    owner, view = pools
    first, second = owner.alloc([b"x-0", b"x-1"]), owner.alloc([b"y-0"])
    view.give(first)
    view.give(second)
    assert view.alloc([b"x-0", b"x-1"]) == first and view.alloc([b"y-0"]) == second


def test_attaching_a_pool_nobody_created_names_it():
    with pytest.raises(FileNotFoundError, match="no shared segment"):
        AttachedPool.attach(f"test-attached-missing-{uuid.uuid4().hex[:8]}")
