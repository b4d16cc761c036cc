"""MooncakeHostPool's own behaviour against a real ``mooncake_master`` (the shared contract is in
tests/integration/test_backend_contract.py): the master launcher, a missing master or wheel,
batches over Mooncake's 1024-key limit, objects read and leased across processes, and a master
restart, the pool's shared memory, and a failed store put. Needs the ``mooncake`` extra and
``libibverbs1`` (scripts/install-mooncake)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
import torch

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import (
    HostPoolBackend,
    IncompleteObject,
    ObjectLeased,
    ObjectNotFound,
    ObjectUnreachable,
    PoolError,
)
from poolbackends.mooncake import MooncakeHostPool
from poolbackends.mooncake_master import MasterConfig, MooncakeMaster, MooncakeNotInstalled, free_port, port_answers
from poolbackends.mooncake_store import MAX_BATCH_KEYS, MooncakeStore, MooncakeStoreError

ROWS = (16, 8)
STORE_LEASE_TTL_MS = 1000


def geo(num_blocks: int) -> PoolGeometry:
    return PoolGeometry(4, ROWS, num_blocks)


def data(seed: int, plane: int, n: int) -> torch.Tensor:
    """[n, 4, ROWS[plane]] bytes, the same in every process."""
    g = torch.Generator().manual_seed(seed * 10 + plane)
    return torch.randint(0, 256, (n, 4, ROWS[plane]), dtype=torch.uint8, generator=g)


def read(pool: HostPoolBackend, keys: list[bytes], plane: int) -> torch.Tensor:
    out = torch.empty(len(keys), 4, ROWS[plane], dtype=torch.uint8)
    pool.get_into(keys, plane, out)
    return out


def fill(pool: HostPoolBackend, keys: list[bytes], seed: int) -> None:
    pool.alloc(keys)
    for p in range(len(ROWS)):
        pool.put_from(keys, p, data(seed, p, len(keys)))


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster.start(MasterConfig(kv_lease_ttl_ms=STORE_LEASE_TTL_MS)) as m:
        yield m


@pytest.fixture(scope="module")
def store(master):
    with MooncakeStore.connect(master.address, global_segment_bytes=64 << 20) as s:
        yield s


@pytest.fixture
def pool(store):
    with MooncakeHostPool(
        store, geo(3000), namespace=f"t-{uuid.uuid4().hex[:8]}", store_lease_ttl_ms=STORE_LEASE_TTL_MS
    ) as p:
        yield p


# ---- the master launcher -------------------------------------------------------------------------


def _listens_on_loopback_only(port: int) -> bool:
    """True if the listening socket on ``port`` is bound to 127.0.0.1 (from /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    local = [r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port]  # 0A: LISTEN
    return bool(local) and all(a.split(":")[0] == "0100007F" for a in local)


def test_master_starts_on_loopback_answers_and_stops():
    m = MooncakeMaster.start(MasterConfig())
    try:
        assert m.running and port_answers("127.0.0.1", m.rpc_port, 1.0)
        assert _listens_on_loopback_only(m.rpc_port) and _listens_on_loopback_only(m.metrics_port)
    finally:
        m.stop()
    assert not m.running and not port_answers("127.0.0.1", m.rpc_port, 0.5)
    m.stop()  # idempotent


def test_a_missing_binary_names_it_and_what_to_install():
    with pytest.raises(
        MooncakeNotInstalled,
        match=r"/nonexistent/mooncake_master.*pip install "
        r"mooncake-transfer-engine-non-cuda==0.3.13.post1.*libibverbs1",
    ):
        MooncakeMaster.start(MasterConfig(binary="/nonexistent/mooncake_master"))


def test_a_master_that_cannot_start_says_why():
    with MooncakeMaster.start(MasterConfig()) as first:  # its RPC port is taken now
        with pytest.raises(RuntimeError, match=rf"127\.0\.0\.1:{first.rpc_port}: something listens there"):
            MooncakeMaster.start(MasterConfig(rpc_port=first.rpc_port, start_timeout_s=10))


def test_no_master_is_a_clear_error_within_the_connect_timeout():
    t0 = time.monotonic()
    with pytest.raises(MooncakeStoreError, match=r"no mooncake_master answers at 127\.0\.0\.1:\d+"):
        MooncakeHostPool.connect(f"127.0.0.1:{free_port('127.0.0.1')}", geo(4), connect_timeout_s=1.0)
    assert time.monotonic() - t0 < 5


def test_poolbackends_imports_without_mooncake_and_construction_says_what_to_install():
    script = (
        "import sys; sys.modules['mooncake'] = None\n"  # as if the wheel were not installed
        "import poolbackends, poolbackends.mooncake\n"
        "from poolbackends.mooncake import MooncakeHostPool\n"
        "from kvcore.pool.geometry import PoolGeometry\n"
        "try:\n"
        "    MooncakeHostPool.connect('127.0.0.1:1', PoolGeometry(4, (8,), 2))\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120).stdout
    assert (
        out.startswith("MooncakeNotInstalled")
        and "mooncake-transfer-engine-non-cuda==0.3.13.post1" in out
        and "libibverbs1" in out
    )
    assert (
        "mooncake.store"
        not in subprocess.run(
            [sys.executable, "-c", "import sys, poolbackends.mooncake; print(sorted(sys.modules))"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    )


# ---- the pool's memory and publishing ----------------------------------------------------------------


def test_the_pool_memory_is_a_shared_segment_released_on_close(store):
    p = MooncakeHostPool(store, geo(4), namespace=f"m-{uuid.uuid4().hex[:8]}")
    path = p.segment.path
    assert os.path.exists(path) and p.plane(1).data_ptr() == p.segment.plane(1).data_ptr()
    fill(p, [b"a"], seed=5)
    assert store.exists([f"{p.namespace}/{b'a'.hex()}"]) == [1]
    p.close()
    assert not os.path.exists(path) and store.exists([f"{p.namespace}/{b'a'.hex()}"]) == [0]
    p.close()  # idempotent


def test_a_failed_store_put_leaves_the_last_plane_unwritten(pool, monkeypatch):
    pool.alloc([b"a", b"b"])
    pool.put_from([b"a", b"b"], 0, data(4, 0, 2))

    def fail(keys, ids):
        raise MooncakeStoreError("put failed (injected)", code=-200, key=keys[0])

    with monkeypatch.context() as m:
        m.setattr(pool._objects, "put", fail)
        with pytest.raises(MooncakeStoreError, match="injected"):
            pool.put_from([b"a", b"b"], 1, data(4, 1, 2))
    assert pool.exists([b"a", b"b"]) == [False, False]
    with pytest.raises(IncompleteObject):
        read(pool, [b"a"], 1)
    pool.put_from([b"a", b"b"], 1, data(4, 1, 2))  # the next try publishes both
    assert pool.exists([b"a", b"b"]) == [True, True] and torch.equal(read(pool, [b"b"], 1), data(4, 1, 2)[1:])


# ---- batches -------------------------------------------------------------------------------------


def test_batches_over_1024_keys(pool, store):
    n = 2 * MAX_BATCH_KEYS + 500
    keys = [f"big-{i}".encode() for i in range(n)]
    fill(pool, keys, seed=3)
    assert pool.exists(keys) == [True] * n and torch.equal(read(pool, keys, 1), data(3, 1, n))
    assert store.exists([f"{pool.namespace}/{k.hex()}" for k in keys]) == [1] * n  # all published
    with pytest.raises(ObjectLeased):  # that check leased them in Mooncake for STORE_LEASE_TTL_MS
        pool.remove(keys)
    assert pool.exists(keys) == [True] * n  # all-or-nothing
    time.sleep(1.5 * STORE_LEASE_TTL_MS / 1000)
    pool.remove(keys)
    assert store.exists([f"{pool.namespace}/{k.hex()}" for k in keys]) == [0] * n and pool.stats().used_blocks == 0


# ---- across processes ------------------------------------------------------------------------------

CHILD = r"""
import sys, torch
from kvcore.pool.host_pool import ObjectLeased
from kvcore.pool.geometry import PoolGeometry
from poolbackends.mooncake import MooncakeHostPool
master, ns, n, ttl = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def data(seed, plane, n):
    g = torch.Generator().manual_seed(seed * 10 + plane)
    return torch.randint(0, 256, (n, 4, (16, 8)[plane]), dtype=torch.uint8, generator=g)
pool = MooncakeHostPool.connect(master, PoolGeometry(4, (16, 8), n), namespace=ns, store_lease_ttl_ms=ttl)
keys = [f"k{i}".encode() for i in range(n)]
pool.alloc(keys)
for p in range(2):
    pool.put_from(keys, p, data(7, p, n))
print("ready", flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "remove":
        try:
            pool.remove([a.encode() for a in args])
            print("removed", flush=True)
        except ObjectLeased as e:
            print("leased", e.key.decode(), flush=True)
    else:
        break
pool.close()
print("closed", flush=True)
"""


class Child:
    """A writer pool in another process (its own Mooncake client and segment), driven over stdin."""

    def __init__(self, master: MooncakeMaster, namespace: str, n: int) -> None:
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, master.address, namespace, str(n), str(STORE_LEASE_TTL_MS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
        )
        assert self.line() == "ready"

    def line(self) -> str:
        out = self.proc.stdout.readline().strip()
        if not out:
            self._err.seek(0)
            raise AssertionError(f"child exited: {self._err.read().decode(errors='replace')[-3000:]}")
        return out

    def ask(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.line()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask("close")
            self.proc.wait(30)


def test_objects_put_by_another_process_are_read_and_leased_here(master, store):
    ns, n = f"x-{uuid.uuid4().hex[:8]}", MAX_BATCH_KEYS + 300
    child = Child(master, ns, n)
    try:
        with MooncakeHostPool(store, geo(8), namespace=ns, store_lease_ttl_ms=STORE_LEASE_TTL_MS) as reader:
            keys = [f"k{i}".encode() for i in range(n)]
            assert reader.exists(keys + [b"nope"]) == [True] * n + [False]
            assert torch.equal(read(reader, keys, 0), data(7, 0, n))  # > 1024 keys across processes
            assert torch.equal(read(reader, [b"k5", b"k1", b"k5"], 1), data(7, 1, n)[[5, 1, 5]])
            with pytest.raises(PoolError, match="read it with get_into"):
                reader.block_ids([b"k1"])
            with pytest.raises(PoolError, match="another pool wrote it"):
                reader.alloc([b"k1"])

            long_lease = reader.lease([b"k1"], 10 * STORE_LEASE_TTL_MS)
            with reader.lease([b"k2"], 10_000):
                assert child.ask("remove k2") == "leased k2"  # the owner cannot remove a leased object
            time.sleep(3 * STORE_LEASE_TTL_MS / 1000)  # the keeper keeps k1's Mooncake lease alive
            assert child.ask("remove k1") == "leased k1"
            assert child.ask("remove k2") == "removed"  # released: Mooncake's lease ran out
            long_lease.release()
            time.sleep(2 * STORE_LEASE_TTL_MS / 1000)
            assert child.ask("remove k1") == "removed"
            assert reader.exists([b"k1", b"k2", b"k3"]) == [False, False, True]
            with pytest.raises(ObjectNotFound) as e:
                read(reader, [b"k3", b"k1"], 0)
            assert e.value.key == b"k1"
    finally:
        child.close()
    assert child.proc.returncode == 0


def test_objects_of_a_dead_owner_fail_one_read_clearly_and_are_then_computed_again():
    """The process that wrote objects dies (SIGKILL): the master lists its objects until its
    --client_ttl (60 s here), but their bytes cannot be read. The first read fails at once with
    TRANSFER_FAIL (an ``ObjectUnreachable``), naming the dead owner, and removes them from the store, so
    the next ``exists`` misses them and the reader writes them itself, well before the master would have
    noticed."""
    with MooncakeMaster.start(MasterConfig(kv_lease_ttl_ms=STORE_LEASE_TTL_MS, client_ttl_s=60)) as m:
        ns, n = f"d-{uuid.uuid4().hex[:8]}", 40
        keys = [f"k{i}".encode() for i in range(n)]
        child = Child(m, ns, n)
        with MooncakeHostPool.connect(
            m.address, geo(64), namespace=ns, store_lease_ttl_ms=STORE_LEASE_TTL_MS
        ) as reader:
            assert torch.equal(read(reader, keys[:3], 0), data(7, 0, 3))  # readable while the owner lives
            child.proc.kill()
            child.proc.wait(10)
            t = time.monotonic()
            assert reader.exists(keys) == [True] * n  # the master does not know yet
            with pytest.raises(
                MooncakeStoreError,
                match=rf"of {n} of {n} object\(s\) \(their owner's segment does "
                rf"not answer.*{n} removed from the store",
            ) as e:
                read(reader, keys, 1)
            assert e.value.code == -800
            assert isinstance(e.value, ObjectUnreachable)  # the one error a reader may answer with a recompute
            assert reader.exists(keys) == [False] * n
            fill(reader, keys, seed=7)  # computed again here: the same bytes
            assert torch.equal(read(reader, keys, 1), data(7, 1, n))
            assert time.monotonic() - t < 30  # long before the master's client_ttl would have dropped them


# ---- master restart ------------------------------------------------------------------------------


def _eventually(check, timeout_s: float = 15.0) -> None:
    """Poll ``check()`` until it returns True; a PoolError counts as "not yet"."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except PoolError as e:
            last = e
        time.sleep(0.2)
    raise AssertionError(f"not true after {timeout_s} s; last error: {last}")


def _put(pool: HostPoolBackend, keys: list[bytes], plane: int, src: torch.Tensor) -> bool:
    pool.put_from(keys, plane, src)
    return True


def test_a_master_restart_fails_requests_clearly_then_the_next_ones_succeed():
    with MooncakeMaster.start(MasterConfig(kv_lease_ttl_ms=STORE_LEASE_TTL_MS)) as m:
        ns = f"r-{uuid.uuid4().hex[:8]}"
        with (
            MooncakeHostPool.connect(
                m.address, geo(16), namespace=ns, store_lease_ttl_ms=STORE_LEASE_TTL_MS, keeper_interval_s=0.2
            ) as owner,
            MooncakeHostPool.connect(m.address, geo(16), namespace=ns, keeper_interval_s=0.2) as other,
        ):
            fill(owner, [b"a", b"b"], seed=1)
            assert other.exists([b"a", b"b"]) == [True, True]
            m.kill()
            with pytest.raises(MooncakeStoreError, match=rf"RPC_FAIL .*master {m.address}") as e:
                other.exists([b"a"])
            assert e.value.code == -900
            with pytest.raises(MooncakeStoreError, match="RPC_FAIL"):
                owner.alloc([b"c"])
            assert owner.exists([b"a"]) == [True]  # the owner's own objects are answered locally
            m.restart()
            _eventually(lambda: len(owner.alloc([b"c"])) == 1)
            owner.put_from([b"c"], 0, data(2, 0, 1))
            _eventually(lambda: _put(owner, [b"c"], 1, data(2, 1, 1)))  # once the clients re-mount their segments
            _eventually(lambda: other.exists([b"a", b"b", b"c"]) == [True] * 3)  # the keeper put a and b again
            assert torch.equal(read(other, [b"a", b"c"], 1), torch.cat([data(1, 1, 2)[:1], data(2, 1, 1)]))
            assert owner.stats().complete_objects == 3
