"""RemoteHostPool against an in-process MetaStore on loopback, beyond the backend contract: two
LocalServices sharing objects through shared memory, registration limits, heartbeats, expiry and
re-join, and the prefill engine giving bit-identical results over it."""

from __future__ import annotations

import os
import time
import uuid

import pytest
import torch
from engine_support import prefill_engine, saved_bytes, seeded_prompt, tiny
from fakeclock import clock  # noqa: F401 - the clock fixture
from structlog.testing import capture_logs

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import (
    HostPoolBackend,
    IncompleteObject,
    ObjectLeased,
    ObjectNotFound,
    PlaneWritten,
    PoolError,
)
from kvcore.pool.segment import SharedSegment
from kvoffload_engine import build
from kvoffload_engine.prefill import PrefillRequest
from kvoffload_metastore.config import MetaStoreConfig
from kvoffload_metastore.server import start
from poolbackends.errors import MetaStoreUnavailable, PoolNotRegistered, WorldSizeExceeded
from poolbackends.remotepool import RemoteHostPool

GEO = PoolGeometry(block_size=4, plane_row_bytes=(8, 16), num_blocks=4, plane_labels=((0, "main"), (0, "indexer")))
K = [bytes([i]) * 16 for i in range(1, 12)]
TIMEOUT_MS = 3000


@pytest.fixture
def metastore(clock):
    ms = start(MetaStoreConfig(port=0, world_size=2, lease_ttl_ms=30_000, heartbeat_timeout_ms=TIMEOUT_MS), clock=clock)
    yield ms
    ms.shutdown(grace_s=0)


@pytest.fixture
def pools(metastore):
    """pools(pool_id, **kw) -> a RemoteHostPool registered with the test MetaStore (closed after)."""
    made: list[RemoteHostPool] = []

    def make(pool_id: str, geometry: PoolGeometry = GEO, **kw) -> RemoteHostPool:
        kw.setdefault("heartbeat_interval_ms", 50)
        pool = RemoteHostPool.create(metastore.target, pool_id, f"rp-{uuid.uuid4().hex[:10]}", geometry, **kw)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def _rows(n: int, plane: int, seed: int) -> torch.Tensor:
    """[n, block_size, row_bytes] random bytes for ``plane``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, GEO.block_size, GEO.plane_row_bytes[plane]), dtype=torch.uint8, generator=g)


def _fill(pool: HostPoolBackend, keys: list[bytes], seed: int = 0) -> list[torch.Tensor]:
    """alloc + write both planes; returns the bytes per plane."""
    pool.alloc(keys)
    data = [_rows(len(keys), p, seed + p) for p in range(GEO.num_planes)]
    for p, rows in enumerate(data):
        pool.put_from(keys, p, rows)
    return data


def _read(pool: HostPoolBackend, keys: list[bytes], plane: int) -> torch.Tensor:
    out = torch.empty((len(keys), GEO.block_size, GEO.plane_row_bytes[plane]), dtype=torch.uint8)
    pool.get_into(keys, plane, out)
    return out


def _wait_until(pred, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _pool_stats(metastore, pool_id: str):
    return next((p for p in metastore.core.stats().pools if p.pool.pool_id == pool_id), None)


# The hooks of a single pool are the backend contract (test_backend_contract.py runs it on
# RemoteHostPool too); here: what only the metastore-indexed pool has.


# ---- two LocalServices ---------------------------------------------------------------------------


def test_a_pool_reads_objects_another_pool_wrote(pools, metastore):
    a, b = pools("dp0"), pools("dp1")
    data = _fill(a, K[:3], seed=3)
    assert b.exists(K[:3]) == [True] * 3
    for p in range(GEO.num_planes):
        assert torch.equal(_read(b, [K[2], K[0]], p), data[p][[2, 0]])  # from a's segment, attached by name
    b_data = _fill(b, K[3:5], seed=7)  # b's own objects live in b's segment
    mixed = _read(b, [K[3], K[1], K[4]], 0)  # both pools in one batch
    assert torch.equal(mixed, torch.stack((b_data[0][0], data[0][1], b_data[0][1])))
    assert torch.equal(_read(a, K[3:5], 1), b_data[1])
    assert (_pool_stats(metastore, "dp0").used_blocks, _pool_stats(metastore, "dp1").used_blocks) == (3, 2)
    with pytest.raises(PoolError, match="views only pool 'dp1'"):
        b.block_ids(K[:1])
    with pytest.raises(PoolError, match="writes only objects it allocated"):
        b.put_from(K[:1], 0, data[0][:1])
    with b.lease(K[:1], 60_000):  # a lease from either LocalService protects the object everywhere
        with pytest.raises(ObjectLeased):
            a.remove(K[:1])
    a.remove(K[:1])
    with pytest.raises(ObjectNotFound):
        _read(b, K[:1], 0)


def test_a_pool_on_another_host_has_no_data_path(pools):
    a, b = pools("dp0", host_id="host-a"), pools("dp1", host_id="host-b")
    _fill(a, K[:1])
    assert b.exists(K[:1]) == [True]
    with pytest.raises(PoolError, match="cross-host data path is not available for the pool") as info:
        _read(b, K[:1], 0)
    assert "host-a" in str(info.value) and info.value.key == K[0]


def test_the_default_host_id_is_the_one_shared_memory_uses(pools, metastore, monkeypatch):
    """One host identity for the pool and the segments (kvcore.pool.segment.host_id), so KVOFFLOAD_HOST_ID
    moves both: a pool registered under it is the one other processes of that id can attach."""
    monkeypatch.setenv("KVOFFLOAD_HOST_ID", "forced-host")
    pool = pools("dp0")
    assert pool.host_id == "forced-host"
    assert [r.host for r in metastore.core.pools()] == ["forced-host"]


def test_world_size_refusal_is_clear_and_leaves_nothing_behind(pools, metastore):
    pools("dp0"), pools("dp1")
    name = f"rp-refused-{uuid.uuid4().hex[:8]}"
    with pytest.raises(WorldSizeExceeded, match=r"refused pool 'dp2'.*world_size=2"):
        RemoteHostPool.create(metastore.target, "dp2", name, GEO)
    assert not os.path.exists(SharedSegment.path_for(name))
    assert len(metastore.core.pools()) == 2


# ---- heartbeats and lifecycle --------------------------------------------------------------------


def test_heartbeat_interval_defaults_to_the_metastores_and_must_beat_its_timeout(pools, metastore):
    assert pools("dp0", heartbeat_interval_ms=None).membership.heartbeat_interval_ms == TIMEOUT_MS // 3
    with pytest.raises(ValueError, match="heartbeat_interval_ms must be an int in \\[1, 3000\\)"):
        pools("dp1", heartbeat_interval_ms=TIMEOUT_MS)
    assert [r.pool_id for r in metastore.core.pools()] == ["dp0"]  # the refused one deregistered again


def test_heartbeats_keep_the_pool_alive(pools, metastore, clock):
    pool = pools("dp0")
    _fill(pool, K[:1])
    for _ in range(3):  # 2.1 heartbeat timeouts of MetaStore time, with a beat in each step
        clock.advance_ms(0.7 * TIMEOUT_MS)
        _wait_until(lambda: _pool_stats(metastore, "dp0").heartbeat_age_ms == 0, "a heartbeat")
    assert pool.alive and pool.exists(K[:1]) == [True] and metastore.core.stats().pools_expired == 0


def test_failed_heartbeats_are_retried_and_an_expired_pool_refuses_operations(pools, metastore, clock):
    pool, other = pools("dp0"), pools("dp1")
    _fill(pool, K[:2])
    real_beat = pool.client.heartbeat

    def partitioned(*a, **kw):
        raise MetaStoreUnavailable("MetaStore Heartbeat: UNAVAILABLE: partitioned by the test")

    with capture_logs() as logs:
        pool.client.heartbeat = partitioned
        _wait_until(lambda: pool.membership.heartbeat_failures >= 2, "two failed heartbeats")
        assert pool.alive  # failures alone do not kill the pool: the MetaStore decides
        clock.advance_ms(0.7 * TIMEOUT_MS)
        _wait_until(lambda: _pool_stats(metastore, "dp1").heartbeat_age_ms == 0, "dp1 to beat")
        clock.advance_ms(0.4 * TIMEOUT_MS)  # dp0 has been silent for 1.1 timeouts, dp1 for 0.4
        assert other.exists(K[:2]) == [False, False]  # the MetaStore expired dp0 and dropped its objects
        pool.client.heartbeat = real_beat  # the partition heals: the next beat learns the pool is gone
        _wait_until(lambda: not pool.alive, "the pool to learn it expired")
    failed = [e for e in logs if e["event"] == "remote_pool_heartbeat_failed"]
    assert len(failed) >= 2 and "partitioned" in failed[0]["error"]
    assert any(e["event"] == "remote_pool_dead" for e in logs)
    for op in (lambda: pool.alloc(K[5:6]), lambda: pool.exists(K[:1]), lambda: pool.plane(0), pool.heartbeat):
        with pytest.raises(PoolNotRegistered, match="'dp0' is no longer registered.*close it and create it again"):
            op()
    assert other.alive and metastore.core.stats().pools_expired == 1
    path = pool.segment.path
    pool.close()
    assert not os.path.exists(path)


def test_a_service_pool_rejoins_after_the_metastore_lost_it(pools, metastore, clock):
    """rejoin=True (what the prefill uses): a MetaStore that forgot the pool (expired here; a restart
    is the same) gets it registered again at the next beat — empty, and usable."""
    pool = pools("dp0", rejoin=True)
    _fill(pool, K[:2])
    metastore.core.deregister_pool("dp0")
    with capture_logs() as logs:
        _wait_until(lambda: pool.membership.rejoins == 1, "the pool to rejoin")
    assert any(e["event"] == "remote_pool_rejoined" for e in logs)
    assert pool.alive and pool.exists(K[:2]) == [False, False]  # the index starts empty
    data = _fill(pool, K[2:4], seed=7)
    out = torch.empty_like(data[0])
    pool.get_into(K[2:4], 0, out)
    assert torch.equal(out, data[0])


def test_close_stops_heartbeats_deregisters_and_unlinks(pools, metastore, clock):
    pool = pools("dp0")
    _fill(pool, K[:2])
    path, thread = pool.segment.path, pool.membership._thread
    pool.close()
    pool.close()  # idempotent
    assert not thread.is_alive() and not os.path.exists(path) and not pool.alive
    assert metastore.core.pools() == [] and metastore.core.stats().objects == 0
    with pytest.raises(PoolError, match="closed"):
        pool.exists(K[:1])
    clock.advance_ms(10 * TIMEOUT_MS)
    assert metastore.core.stats().pools_expired == 0  # it left cleanly: nothing to expire


# ---- the prefill engine over either backend ------------------------------------------------------


def _prefill_twice(pool: HostPoolBackend, prompts: list[torch.Tensor]) -> list[tuple]:
    model = tiny(torch.float32, True)
    eng = prefill_engine(model, pool, buffers=2, independent=[0], chunk_size=24)
    out = []
    try:
        for i, prompt in enumerate(prompts):
            res = eng.run(PrefillRequest(f"r{i}", prompt))
            out.append(
                (
                    res.logits.clone(),
                    res.first_token,
                    res.draft_logits.clone(),
                    res.num_cached_tokens,
                    saved_bytes(pool, res.keys),
                )
            )
            eng.release(res)
        assert pool.stats().live_leases == 0
    finally:
        eng.close()
    return out


def test_prefill_over_the_metastore_pool_is_bit_identical(metastore):
    model = tiny(torch.float32, True)
    bs = 8
    shared = seeded_prompt(48, 31)
    prompts = [torch.cat((shared, seeded_prompt(13, 32))), torch.cat((shared, seeded_prompt(9, 33)))]
    local = build.prefill_pool(model, bs, 4 << 20)
    try:
        want = _prefill_twice(local, prompts)
        geometry = local.geometry
    finally:
        local.close()
    remote = RemoteHostPool.create(metastore.target, "prefill-dp0", f"rp-prefill-{uuid.uuid4().hex[:8]}", geometry)
    try:
        got = _prefill_twice(remote, prompts)
    finally:
        remote.close()
    assert [g[3] for g in got] == [w[3] for w in want] == [0, 48]  # the second request hits the prefix cache
    for g, w in zip(got, want):
        assert torch.equal(g[0], w[0]) and g[1] == w[1] and torch.equal(g[2], w[2])
        assert len(g[4]) == len(w[4]) == geometry.num_planes
        for a, b in zip(g[4], w[4]):
            assert torch.equal(a, b)


def test_several_planes_cost_the_round_trips_of_one(pools, metastore):
    """``put_planes_from`` (the prefill's save of a layer: main KV + indexer keys) is one copy lease,
    one MarkWritten and one release for every plane together, not three RPCs per plane; a
    conflicting plane is found before any plane is copied."""
    pool = pools("p0")
    pool.alloc(K[:2])
    data = [_rows(2, p, 40 + p) for p in range(GEO.num_planes)]
    before = metastore.metrics.request_counts()
    pool.put_planes_from(K[:2], dict(enumerate(data)))
    after = metastore.metrics.request_counts()
    calls = {m: after[(m, c)] - before.get((m, c), 0) for (m, c) in after if after[(m, c)] != before.get((m, c), 0)}
    assert calls == {"Lease": 1, "MarkWritten": 1, "ReleaseLease": 1}, calls
    assert pool.exists(K[:2]) == [True, True]
    assert all(torch.equal(_read(pool, K[:2], p), data[p]) for p in range(GEO.num_planes))
    pool.alloc(K[2:3])
    pool.put_from(K[:1], 0, data[0][:1])
    with pytest.raises(PlaneWritten):  # plane 1 of K[0] differs: plane 0 of K[2] is not written either
        pool.put_planes_from(
            [K[2], K[0]],
            {0: torch.cat((_rows(1, 0, 50), data[0][:1])), 1: torch.cat((_rows(1, 1, 51), _rows(1, 1, 52)))},
        )
    with pytest.raises(IncompleteObject, match="no written plane 0"):
        _read(pool, K[2:3], 0)
