"""The store connector's host pools, one per KV cache group: opened at registration, and a step's
prefix hits loaded from them group by group, layer by layer.

Every group's pool holds as many objects (``host_pool_gb`` split by the groups' object sizes), so a
prefix whose blocks one group keeps is kept by every group. A single group's pool keeps the name it
always had; with several, each pool id and segment name ends in ``-g<index>``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence

import structlog
import torch

from kvcore.config.connectors import StoreConnectorConfig
from kvcore.pool.host_pool import HostPoolBackend
from kvcore.pool.segment import sweep_stale_segments
from kvoffload_vllm.group_caches import GroupCaches
from kvoffload_vllm.plan import Transfer
from poolbackends.registry import PoolRequest, open_pool

log = structlog.get_logger("vllm.kvoffload.store")


def open_group_pools(
    store: StoreConnectorConfig, caches: Sequence[GroupCaches], pool_gb: float, timeout_s: float
) -> list[HostPoolBackend]:
    """One pool per group in ``caches``, contributed to the store config's backend (its metastore, its
    mooncake_master: a Mooncake pool advertises this host's address toward the master)."""
    per_object = sum(c.object_bytes for c in caches)
    num_objects = int(pool_gb * 2**30) // per_object
    if num_objects < 1:
        layers = sum(len(c.group.layer_names) for c in caches)
        raise ValueError(
            f"host_pool_gb holds no block: one block of all {layers} layers is "
            f"{per_object} bytes, the pool {int(pool_gb * 2**30)}"
        )
    sweep_stale_segments()
    tag, pools = uuid.uuid4().hex[:8], []
    for c in caches:
        suffix = "" if len(caches) == 1 else f"-g{c.group.index}"
        pool_id = f"vllm-{os.getpid()}-{tag}{suffix}"  # the store config's metastore indexes it (kvoffload)
        geometry = c.geometry(num_objects)
        pools.append(
            open_pool(PoolRequest(store, geometry, f"kvoffload-vllm-pool-{tag}{suffix}", pool_id, timeout_s=timeout_s))
        )
        log.info(
            "kvoffload_pool_registered",
            pool_id=pool_id,
            group=c.group.index,
            block_size=c.group.block_size,
            layers=len(c.group.layer_names),
            object_bytes=c.object_bytes,
            objects=num_objects,
            host_pool_gb=pool_gb,
        )
    return pools


def load_groups(
    loads: Sequence[Transfer],
    caches: Sequence[GroupCaches],
    pools: Sequence[HostPoolBackend],
    layer_done: Callable[[str], None],
) -> tuple[int, int]:
    """Every load's blocks from its group's pool into its vLLM blocks, group by group and layer by
    layer, ``layer_done(name)`` after each layer; (blocks, bytes) loaded. A pool error propagates."""
    blocks = nbytes = 0
    for c, pool in zip(caches, pools, strict=True):
        mine = [t for t in loads if t.group == c.group.index]
        keys = [k for t in mine for k in t.keys]
        ids = torch.tensor([b for t in mine for b in t.block_ids], dtype=torch.long)
        for plane, name in enumerate(c.group.layer_names):
            if keys:
                staging = torch.empty((len(keys), 1, c.page_bytes[plane]), dtype=torch.uint8)
                pool.get_into(keys, plane, staging)
                c.write(plane, ids, staging)
            layer_done(name)
        blocks, nbytes = blocks + len(keys), nbytes + len(keys) * c.object_bytes
    return blocks, nbytes
