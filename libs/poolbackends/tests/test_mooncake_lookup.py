"""Backend "mooncake" beyond one pool, against a real ``mooncake_master``: the lookup the vLLM store's
scheduler asks (``MooncakeLookup``, opened through the registry: exactly the complete objects of its
namespace; a missing master named; a killed and restarted master), the address a pool advertises,
and a layerwise load of another pool's objects, which fetches each object once for all its planes
(``store_fetched``) and never reads one removed since."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from kvcore.config.connectors import StoreConnectorConfig
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import ObjectNotFound, PoolError
from poolbackends.mooncake import MooncakeHostPool
from poolbackends.mooncake_lookup import MooncakeLookup
from poolbackends.mooncake_master import MasterConfig, MooncakeMaster, free_port
from poolbackends.mooncake_store import MooncakeStore, MooncakeStoreError, address_toward
from poolbackends.registry import PoolOpenError, open_lookup
from poolbackends.store_fetched import FetchedObjects

ROWS = (16, 8, 24)  # three planes
LEASE_MS = 1000


def geo(num_blocks: int = 16) -> PoolGeometry:
    return PoolGeometry(4, ROWS, num_blocks)


def data(seed: int, plane: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + plane)
    return torch.randint(0, 256, (n, 4, ROWS[plane]), dtype=torch.uint8, generator=g)


def read(pool: MooncakeHostPool, keys: list[bytes], plane: int) -> torch.Tensor:
    out = torch.empty(len(keys), 4, ROWS[plane], dtype=torch.uint8)
    pool.get_into(keys, plane, out)
    return out


def config(master: str, namespace: str) -> StoreConnectorConfig:
    return StoreConnectorConfig(backend="mooncake", mooncake_master=master, mooncake_namespace=namespace)


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster.start(MasterConfig(kv_lease_ttl_ms=LEASE_MS)) as m:
        yield m


@pytest.fixture(scope="module")
def store(master):
    with MooncakeStore.connect(master.address, global_segment_bytes=64 << 20) as s:
        yield s


def pool(store: MooncakeStore, ns: str) -> MooncakeHostPool:
    return MooncakeHostPool(store, geo(), namespace=ns, store_lease_ttl_ms=LEASE_MS)


def test_the_lookup_sees_exactly_the_complete_objects_of_its_namespace(master, store):
    ns = f"l-{uuid.uuid4().hex[:8]}"
    with pool(store, ns) as writer:
        writer.alloc([b"k0", b"k1", b"half"])
        for p in range(len(ROWS)):
            writer.put_from([b"k0", b"k1"], p, data(1, p, 2))
        writer.put_from([b"half"], 0, data(2, 0, 1))  # one plane of three: not complete
        lookup = open_lookup(config(master.address, ns))
        other = open_lookup(config(master.address, f"{ns}-other"))
        try:
            assert isinstance(lookup, MooncakeLookup) and lookup.master == master.address
            assert lookup.exists([b"k0", b"half", b"k1", b"nope"]) == [True, False, True, False]
            assert other.exists([b"k0", b"k1"]) == [False, False]  # another namespace shares nothing
            assert lookup.exists([]) == []
        finally:
            lookup.close()
            other.close()


def test_a_lookup_without_a_master_names_the_address():
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    t0 = time.monotonic()
    with pytest.raises(PoolOpenError, match=rf"backend 'mooncake': no mooncake_master answers at {address}"):
        open_lookup(config(address, "x"), timeout_s=1.0)
    assert time.monotonic() - t0 < 5


def test_a_killed_master_fails_lookups_at_once_and_a_restarted_one_answers_again():
    with MooncakeMaster.start(MasterConfig(kv_lease_ttl_ms=LEASE_MS)) as m:
        lookup = MooncakeLookup.connect(m.address, "r")
        idle = MooncakeLookup.connect(m.address, "r")  # not asked while the master is down
        try:
            assert lookup.exists([b"k"]) == idle.exists([b"k"]) == [False]
            m.kill()
            for _ in range(3):  # each at once, not after the wheel's own reconnect attempts (~4 s)
                t0 = time.monotonic()
                with pytest.raises(MooncakeStoreError, match=rf"-900 RPC_FAIL.*master {m.address}") as e:
                    lookup.exists([b"k"])
                assert isinstance(e.value, PoolError) and time.monotonic() - t0 < 1
            m.restart()
            assert idle.exists([b"k"]) == [False]  # its first call after the restart answers
            deadline = time.monotonic() + 15
            while True:  # the client finds the restarted master by itself
                try:
                    assert lookup.exists([b"k"]) == [False]
                    break
                except MooncakeStoreError:
                    assert time.monotonic() < deadline, "the lookup never reached the restarted master"
                    time.sleep(0.2)
        finally:
            lookup.close()
            idle.close()


def test_a_pool_advertises_its_address_toward_the_master(master, store):
    assert address_toward(master.address) == "127.0.0.1"
    assert address_toward("10.1.2.3:50051") not in ("", "0.0.0.0")  # the route's source address, no packet sent


def test_a_load_fetches_each_object_once_for_all_its_planes(store, monkeypatch):
    ns, keys = f"f-{uuid.uuid4().hex[:8]}", [f"k{i}".encode() for i in range(5)]
    with pool(store, ns) as writer, pool(store, ns) as reader:
        writer.alloc(keys)
        for p in range(len(ROWS)):
            writer.put_from(keys, p, data(3, p, len(keys)))
        fetched: list[int] = []
        real = reader._store_read
        monkeypatch.setattr(reader, "_store_read", lambda ks, staging: (fetched.append(len(ks)), real(ks, staging)))
        for p in range(len(ROWS)):  # layer by layer, as the vLLM store loads a hit
            assert torch.equal(read(reader, keys, p), data(3, p, len(keys)))
        assert fetched == [5] and len(reader._fetched) == 0  # one fetch; nothing kept once every plane was read
        assert torch.equal(read(reader, keys[3:1:-1], 1), data(3, 1, 5)[[3, 2]])  # a new load fetches again
        assert fetched == [5, 2]
        time.sleep(2 * LEASE_MS / 1000)  # the reader's checks leased the objects: let the leases run out
        writer.remove([b"k2"])
        with pytest.raises(ObjectNotFound):  # kept for planes 0 and 2, but removed since: not read
            read(reader, [b"k3", b"k2"], 0)


def test_kept_objects_are_bounded_in_bytes_and_time():
    kept = FetchedObjects(num_planes=2, max_bytes=100, ttl_s=0.2)
    rows = torch.arange(120, dtype=torch.uint8).reshape(3, 40)
    kept.keep([b"a", b"b", b"c"], rows, plane=0)
    assert kept.take([b"a"], 1) is None and len(kept) == 2  # the oldest made room
    assert torch.equal(kept.take([b"c"], 1)[b"c"], rows[2]) and len(kept) == 1  # both planes read: dropped
    time.sleep(0.3)
    assert kept.take([b"b"], 1) is None and len(kept) == 0  # expired
    one = FetchedObjects(num_planes=1, max_bytes=100)
    one.keep([b"a"], rows[:1], plane=0)
    assert len(one) == 0  # a single plane: nothing left to read
