"""RemoteHostPool and its MetaStore client without a MetaStore: a create that cannot reach the
MetaStore, and the arguments it refuses. The hooks against a real
MetaStore are tested in tests/integration/test_remote_pool.py."""

import os
import uuid

import pytest

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import HostPoolBackend
from kvcore.pool.segment import SharedSegment
from poolbackends.client import MetaStoreClient
from poolbackends.errors import MetaStoreUnavailable
from poolbackends.remotepool import RemoteHostPool

GEO = PoolGeometry(block_size=4, plane_row_bytes=(8,), num_blocks=2)


def test_remote_pool_implements_every_hook():
    assert issubclass(RemoteHostPool, HostPoolBackend) and not RemoteHostPool.__abstractmethods__


def test_unreachable_metastore_fails_create_without_a_stale_segment():
    name = f"rp-unreachable-{uuid.uuid4().hex[:8]}"
    with pytest.raises(MetaStoreUnavailable):
        RemoteHostPool.create("127.0.0.1:1", "dp0", name, GEO, timeout_s=0.2)
    assert not os.path.exists(SharedSegment.path_for(name))


def test_a_pool_needs_a_client_with_its_pool_id():
    with MetaStoreClient("127.0.0.1:1") as client, SharedSegment.create(f"rp-{uuid.uuid4().hex[:8]}", GEO) as seg:
        with pytest.raises(ValueError, match="pool_id"):
            RemoteHostPool(client, seg)
