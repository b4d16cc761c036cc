"""Shared fixtures: an injectable clock and an in-process server on loopback (a free port)."""

import pytest
from fakeclock import clock  # noqa: F401 - the clock fixture

from kvoffload_metastore.config import MetaStoreConfig
from kvoffload_metastore.server import start


@pytest.fixture
def running(clock):
    config = MetaStoreConfig(
        port=0, world_size=2, lease_ttl_ms=1000, heartbeat_timeout_ms=5000, dram_bytes_per_local_service=10 * 2**30
    )
    server = start(config, clock=clock)
    yield server
    server.shutdown(grace_s=0)


@pytest.fixture
def channel(running):
    """A plain gRPC channel to ``running``."""
    import grpc

    with grpc.insecure_channel(running.target) as ch:
        yield ch
