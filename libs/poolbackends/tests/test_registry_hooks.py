"""Every ``kvcore.pool.registry`` entry's hooks exist here, and backend ``"kvoffload"`` opens its pool
through them: in this process without a metastore, registered with a real one (started by its
launcher) with one, whose ``Exists`` is its lookup."""

from __future__ import annotations

import uuid

import pytest
import torch

from kvcore.config.connectors import StoreConnectorConfig
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.local import LocalHostPool
from kvcore.pool.registry import POOL_BACKENDS, load
from poolbackends import registry
from poolbackends.metastore_server import MetastoreError, MetastoreServer, MetastoreSettings
from poolbackends.registry import PoolOpenError, PoolRequest, open_lookup, open_pool, readiness, start_server
from poolbackends.remotepool import RemoteHostPool
from svcruntime.serverprocess import ServerProcess

GEO = PoolGeometry(block_size=4, plane_row_bytes=(8,), num_blocks=4)


@pytest.mark.parametrize("name", sorted(POOL_BACKENDS))
def test_each_backends_hooks_resolve(name: str) -> None:
    backend = POOL_BACKENDS[name]
    assert callable(load(backend.factory))
    assert backend.readiness is None or callable(load(backend.readiness))
    assert issubclass(load(backend.launcher), ServerProcess)
    assert backend.lookup is None or callable(load(backend.lookup))


def _request(**keys) -> PoolRequest:
    tag = uuid.uuid4().hex[:8]
    return PoolRequest(StoreConnectorConfig(backend="kvoffload", **keys), GEO, f"registry-test-{tag}", f"pool-{tag}")


def test_the_embedded_backend_without_a_metastore_keeps_its_index_here() -> None:
    with open_pool(_request()) as pool:
        assert isinstance(pool, LocalHostPool)
        assert readiness("kvoffload")(pool) == ""


def test_the_embedded_backend_registers_with_the_metastore_its_launcher_started() -> None:
    server = start_server("kvoffload")
    try:
        assert isinstance(server, MetastoreServer) and server.running
        with open_pool(_request(metastore=server.address)) as pool:
            assert isinstance(pool, RemoteHostPool)
            assert readiness("kvoffload")(pool) == ""
            assert [p.pool.pool_id for p in pool.client.meta_stats().pools] == [pool.pool_id]
    finally:
        server.stop()


def test_the_embedded_backends_lookup_asks_its_metastore() -> None:
    server = start_server("kvoffload")
    try:
        with open_pool(_request(metastore=server.address)) as pool:
            pool.alloc([b"k"])
            pool.put_from([b"k"], 0, torch.zeros(1, 4, 8, dtype=torch.uint8))
            lookup = open_lookup(StoreConnectorConfig(backend="kvoffload", metastore=server.address), 2.0)
            try:
                assert lookup.exists([b"k", b"nope"]) == [True, False]
            finally:
                lookup.close()
    finally:
        server.stop()
    with pytest.raises(ValueError, match="backend 'memcache' has no lookup: the vLLM store"):
        open_lookup(StoreConnectorConfig(backend="memcache"))


def test_a_metastore_on_a_taken_port_is_refused_up_front() -> None:
    server = MetastoreServer.start(MetastoreSettings())
    try:
        with pytest.raises(MetastoreError, match="is taken"):
            MetastoreServer.start(MetastoreSettings(port=server.port, start_timeout_s=5.0))
    finally:
        server.stop()


def _named_request(backend: str, **keys: str) -> PoolRequest:
    return PoolRequest(
        StoreConnectorConfig(backend=backend, **keys),
        geometry=None,  # type: ignore[arg-type]
        name="seg",
        pool_id="pool",
    )


def test_open_pool_calls_the_backends_factory_and_names_the_backend_when_it_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    called: list[tuple[str, PoolRequest]] = []

    def fake_load(ref: str):
        def factory(request: PoolRequest):
            called.append((ref, request))
            if request.store.backend == "mooncake":
                raise PoolOpenError("no mooncake_master answers at h:1")
            return "the pool"

        return factory

    monkeypatch.setattr(registry, "load", fake_load)
    request = _named_request("kvoffload")
    assert open_pool(request) == "the pool"
    assert called == [(POOL_BACKENDS["kvoffload"].factory, request)]
    with pytest.raises(PoolOpenError) as info:
        open_pool(_named_request("mooncake", mooncake_master="h:1"))
    assert str(info.value) == "backend 'mooncake': no mooncake_master answers at h:1"


def test_a_backend_without_a_readiness_check_is_always_ready() -> None:
    assert POOL_BACKENDS["memcache"].readiness is None
    assert readiness("memcache")(object()) == ""
