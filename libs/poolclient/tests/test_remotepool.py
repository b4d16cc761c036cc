"""RemoteHostPool and its MetaStore client without a MetaStore: the error mapping of failed calls,
and a create that cannot reach the MetaStore. The hooks against a real
MetaStore are tested in tests/integration/test_remote_pool.py."""

import os
import uuid

import grpc
import pytest

from kvcore.hostpool import HostPoolBackend, ObjectNotFound, PoolError, PoolFullError
from kvcore.segment import PoolGeometry, SharedSegment
from poolclient.client import MetaStoreClient
from poolclient.errors import MetaStoreUnavailable, WorldSizeExceeded
from poolclient.remotepool import RemoteHostPool
from poolclient.wire import ERROR_MD, FULL_MD, KEY_MD, error_from_rpc

GEO = PoolGeometry(block_size=4, plane_row_bytes=(8,), num_blocks=2)


def test_remote_pool_implements_every_hook():
    assert issubclass(RemoteHostPool, HostPoolBackend) and not RemoteHostPool.__abstractmethods__


class _Failed(grpc.RpcError):
    def __init__(self, code, details="", md=()):
        self._code, self._details, self._md = code, details, md

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._md


def test_failed_calls_map_to_kvcore_types():
    e = error_from_rpc(_Failed(grpc.StatusCode.NOT_FOUND, "no object", ((ERROR_MD, "ObjectNotFound"),
                                                                        (KEY_MD, b"k1"))), "Lease")
    assert type(e) is ObjectNotFound and e.key == b"k1" and str(e) == "no object"
    e = error_from_rpc(_Failed(grpc.StatusCode.FAILED_PRECONDITION, "full", ((ERROR_MD, "WorldSizeExceeded"),)), "R")
    assert type(e) is WorldSizeExceeded
    # a name that does not match its status code, or names no known type, is never rebuilt
    for name, code in (("WorldSizeExceeded", grpc.StatusCode.NOT_FOUND), ("os.system", grpc.StatusCode.INTERNAL)):
        e = error_from_rpc(_Failed(code, "x", ((ERROR_MD, name),)), "Exists")
        assert type(e) is PoolError and code.name in str(e)
    md = tuple((FULL_MD[n], str(v)) for n, v in (("needed", 3), ("free", 1), ("evictable", 1), ("num_blocks", 4)))
    e = error_from_rpc(_Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "pool 'p0': full", md + ((KEY_MD, b"k"),)), "A")
    assert isinstance(e, PoolFullError) and (e.needed, e.free, e.evictable, e.key) == (3, 1, 1, b"k")
    assert type(error_from_rpc(_Failed(grpc.StatusCode.INVALID_ARGUMENT, "bad"), "A")) is ValueError
    e = error_from_rpc(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"), "Exists")
    assert type(e) is MetaStoreUnavailable and e.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unreachable_metastore_fails_create_without_a_stale_segment():
    name = f"rp-unreachable-{uuid.uuid4().hex[:8]}"
    with pytest.raises(MetaStoreUnavailable):
        RemoteHostPool.create("127.0.0.1:1", "dp0", name, GEO, timeout_s=0.2)
    assert not os.path.exists(SharedSegment.path_for(name))


def test_a_pool_needs_a_client_with_its_pool_id():
    with MetaStoreClient("127.0.0.1:1") as client, SharedSegment.create(f"rp-{uuid.uuid4().hex[:8]}", GEO) as seg:
        with pytest.raises(ValueError, match="pool_id"):
            RemoteHostPool(client, seg)
