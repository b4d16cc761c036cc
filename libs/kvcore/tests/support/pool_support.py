"""Small host pools and block payloads shared by kvcore's pool, lease and eviction tests."""

import uuid

import pytest
import torch

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.local import LocalHostPool

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
