"""The data ``test_backend_contract`` writes into every backend: the pool ``geometry`` (two planes: 16 and
8 bytes per token row, 4 tokens per block), seeded random blocks, and the batch helpers ``fill``, ``read``
and ``keys``."""

from __future__ import annotations

import torch

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import HostPoolBackend

BS = 4
ROWS = (16, 8)  # plane 0: 16 bytes per token row, plane 1: 8


def geometry(num_blocks: int) -> PoolGeometry:
    return PoolGeometry(BS, ROWS, num_blocks)


def block(seed: int, plane: int, n: int = 1) -> torch.Tensor:
    """[n, BS, ROWS[plane]] random bytes."""
    g = torch.Generator().manual_seed(seed * 10 + plane)
    return torch.randint(0, 256, (n, BS, ROWS[plane]), dtype=torch.uint8, generator=g)


def fill(pool: HostPoolBackend, keys: list[bytes], seed: int = 0) -> None:
    pool.alloc(keys)
    for p in range(len(ROWS)):
        pool.put_from(keys, p, block(seed, p, len(keys)))


def read(pool: HostPoolBackend, keys: list[bytes], plane: int) -> torch.Tensor:
    out = torch.empty(len(keys), BS, ROWS[plane], dtype=torch.uint8)
    pool.get_into(keys, plane, out)
    return out


def keys(*names: str) -> list[bytes]:
    return [n.encode() for n in names]
