import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import kvcore.hostpool as hp
from kvcore.hostpool import (
    HostPoolBackend,
    IncompleteObject,
    LeaseExpired,
    LocalHostPool,
    LRUEviction,
    NoEviction,
    ObjectExists,
    ObjectLeased,
    ObjectNotFound,
    PoolError,
    PoolFullError,
    PoolGeometry,
    SharedSegment,
)
from kvcore.layout import KVLayout

SRC = str(Path(__file__).resolve().parents[1] / "src")
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


# ---- hook map --------------------------------------------------------------------------------


def test_hook_map_matches_abstract_methods():
    documented = re.findall(r"^``(\w+)(?:\([^)]*\))?``$", hp.__doc__, re.M)  # one entry per line
    assert len(documented) == len(set(documented))
    assert set(documented) == set(HostPoolBackend.__abstractmethods__)


# ---- geometry --------------------------------------------------------------------------------


def test_geometry_derived_sizes():
    g = PoolGeometry(BS, ROWS, 10)
    assert g.num_planes == 2 and g.block_bytes == BS * 24 and g.total_bytes == 10 * BS * 24
    assert g.plane_bytes(1) == 10 * BS * 8
    g2 = PoolGeometry.for_capacity(BS, [16, 8], 10 * BS * 24 + 5)
    assert g2.num_blocks == 10 and g2.plane_row_bytes == (16, 8)
    with pytest.raises(ValueError, match=r"capacity_bytes=50 holds no block: one block is block_bytes=96"):
        PoolGeometry.for_capacity(BS, [16, 8], 50)


def test_geometry_from_layout():
    layout = KVLayout.for_mla(num_hidden_layers=2, kv_lora_rank=8, qk_rope_head_dim=4, block_size=4,
                              num_mtp_layers=1, index_head_dim=4, index_dtype="float32")
    g = PoolGeometry.from_layout(layout, 1 << 20, include_indexer=True)
    assert g.plane_row_bytes == (24, 16, 24, 16, 24, 16)
    assert g.plane_index(2, "main") == 4 and g.plane_index(2, "indexer") == 5
    assert g.block_bytes == 4 * layout.bytes_per_token and g.num_blocks == (1 << 20) // g.block_bytes
    g = PoolGeometry.from_layout(layout, 1 << 20, include_indexer=False)
    assert g.plane_row_bytes == (24, 24, 24) and g.plane_index(1) == 1
    assert g.block_bytes == 4 * layout.main_bytes_per_token
    with pytest.raises(ValueError, match="no plane"):
        g.plane_index(1, "indexer")


@pytest.mark.parametrize(
    "args, match",
    [((0, (8,), 1), "block_size"), ((4, (), 1), "at least one plane"), ((4, (8, 0), 1), r"plane_row_bytes\[1\]"),
     ((4, (8,), 0), "num_blocks"), ((4, (8,), 1, ((0, "main"), (1, "main"))), "2 entries for 1 planes"),
     ((4, (8, 8), 1, ((0, "main"), (0, "main"))), "unique"), ((4, (8,), 1, ((0, "kv"),)), "label")],
)
def test_geometry_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        PoolGeometry(*args)


# ---- shared segment --------------------------------------------------------------------------


def test_segment_layout_and_exists_semantics():
    name = _name()
    g = _geometry(5)
    with SharedSegment.create(name, g) as seg:
        assert seg.path == f"/dev/shm/kvoffload-{name}" and os.path.exists(seg.path)
        for p in range(g.num_planes):
            v = seg.plane(p)
            assert v.shape == (5, BS, ROWS[p]) and v.dtype == torch.uint8 and v.is_contiguous()
            assert seg.plane_offsets[p] % 4096 == 0
        seg.plane(0)[1] = 9
        assert seg.plane(1).sum() == 0  # planes do not overlap
        with pytest.raises(FileExistsError, match="replace=True"):
            SharedSegment.create(name, g)
        with pytest.raises(ValueError, match="plane"):
            seg.plane(2)
    assert not os.path.exists(f"/dev/shm/kvoffload-{name}")  # the creator's context unlinks


def test_segment_replace_and_unlink_idempotent():
    name = _name()
    a = SharedSegment.create(name, _geometry(2))
    a.plane(0).fill_(1)
    b = SharedSegment.create(name, _geometry(3), replace=True)
    assert b.geometry.num_blocks == 3 and b.plane(0).sum() == 0
    assert a.plane(0).sum() == 2 * BS * ROWS[0]  # the old mapping still works
    a.close()
    b.close()
    b.unlink()
    b.unlink()
    assert b.closed
    with pytest.raises(ValueError, match="closed"):
        b.plane(0)


def test_segment_close_with_live_view_is_safe():
    seg = SharedSegment.create(_name(), _geometry(2))
    view = seg.plane(1)
    seg.close()
    seg.unlink()
    view.fill_(3)  # mapping outlives close() while views exist
    assert int(view.sum()) == 3 * view.numel()


def test_attach_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no shared segment"):
        SharedSegment.attach(_name())
    name = _name()
    path = f"/dev/shm/kvoffload-{name}"
    with open(path, "wb") as f:
        f.write(b"NOTMAGIC" + b"\0" * 100)
    try:
        with pytest.raises(ValueError, match="not a kvoffload pool segment"):
            SharedSegment.attach(name)
    finally:
        os.unlink(path)
    for bad in ("a/b", "", "x" * 300):
        with pytest.raises(ValueError, match="segment name"):
            SharedSegment.attach(bad)


def test_cross_process_attach():
    name = _name()
    code = (
        "import sys, torch; from kvcore.hostpool import SharedSegment\n"
        "seg = SharedSegment.attach(sys.argv[1])\n"
        "assert seg.geometry.plane_row_bytes == (16, 8), seg.geometry\n"
        "assert int(seg.plane(0)[2].sum()) == 7 * seg.plane(0)[2].numel()\n"
        "seg.plane(1)[3] = torch.arange(32, dtype=torch.uint8).view(4, 8)\n"
        "seg.close()\n"
    )
    with SharedSegment.create(name, _geometry(5)) as seg:
        seg.plane(0)[2] = 7
        subprocess.run([sys.executable, "-c", code, name], check=True, env=dict(os.environ, PYTHONPATH=SRC),
                       timeout=60)
        assert torch.equal(seg.plane(1)[3], torch.arange(32, dtype=torch.uint8).view(4, 8))
        assert seg.plane(1)[[0, 1, 2, 4]].sum() == 0


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
    with pytest.raises(IncompleteObject) as e:
        pool.get_into(k[:1], 0, torch.empty(1, BS, 16, dtype=torch.uint8))
    assert e.value.key == b"a"
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


def test_lease_requires_complete_and_release_is_idempotent(make_pool):
    pool = make_pool(3)
    _fill(pool, _keys("a"))
    pool.alloc(_keys("w"))
    with pytest.raises(IncompleteObject):
        pool.lease(_keys("a", "w"), 1000)
    assert pool.stats().live_leases == 0
    with pool.lease(_keys("a"), 1000) as l1, pool.lease(_keys("a"), 1000) as l2:
        l1.release()
        l1.release()
        with pytest.raises(ObjectLeased):
            pool.remove(_keys("a"))  # l2 still protects
        assert pool.stats().live_leases == 1
    assert not l2.live and pool.stats().lease_expiries == 0
    pool.remove(_keys("a"))


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
