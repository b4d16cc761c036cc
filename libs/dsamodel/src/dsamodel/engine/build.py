"""Constructors that wire a model to kvcore: host pools and the prefill engine from plain settings."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from kvcore.eviction import LRUEviction, NoEviction
from kvcore.hostpool import LocalHostPool
from kvcore.plan import BufferPlan
from kvcore.segment import PoolGeometry

from dsamodel.engine.layout import kv_layout
from dsamodel.engine.prefill import LayerwisePrefill
from dsamodel.model import DSAModel


def _name(prefix: str, name: str | None) -> str:
    return name or f"{prefix}-{uuid.uuid4().hex[:12]}"


def prefill_pool(model: DSAModel, block_size: int, capacity_bytes: int, name: str | None = None) -> LocalHostPool:
    """The prefill side's host pool: main + indexer planes of every layer, LRU prefix cache."""
    geo = PoolGeometry.from_layout(kv_layout(model.config, block_size, model.dtype), capacity_bytes,
                                   include_indexer=True)
    return LocalHostPool.create(_name("kvoffload-prefill", name), geo, eviction=LRUEviction())


def remote_prefill_pool(model: DSAModel, block_size: int, capacity_bytes: int, *, metastore: str, pool_id: str,
                        name: str | None = None):
    """The prefill side's host pool registered with a kvoffload-metastore (its index lives there)."""
    from kvcore.remotepool import RemoteHostPool

    geo = PoolGeometry.from_layout(kv_layout(model.config, block_size, model.dtype), capacity_bytes,
                                   include_indexer=True)
    return RemoteHostPool.create(metastore, pool_id, _name("kvoffload-prefill", name), geo, replace=True,
                                 rejoin=True)  # a restarted metastore must not retire the prefill


def decode_pool(model: DSAModel, block_size: int, capacity_bytes: int, name: str | None = None) -> LocalHostPool:
    """The decode side's host pool: main planes only (the indexer stays on device); never evicts."""
    geo = PoolGeometry.from_layout(kv_layout(model.config, block_size, model.dtype), capacity_bytes,
                                   include_indexer=False)
    return LocalHostPool.create(_name("kvoffload-decode", name), geo, eviction=NoEviction())


def prefill_engine(
    model: DSAModel,
    pool: LocalHostPool,
    *,
    buffers: int | None,
    independent: Iterable[int] | str,
    chunk_size: int,
    max_model_len: int,
    prefetch: int | None = None,
    model_id: str = "model",
    **kw,
) -> LayerwisePrefill:
    """A prefill engine over ``buffers`` shared slots (None: no reuse); negative layers count from the end."""
    layout = kv_layout(model.config, pool.geometry.block_size, model.dtype)
    n = layout.num_layers
    indep = range(n) if independent == "all" else sorted({i % n for i in independent})
    plan = BufferPlan.build(layout, buffers, indep)
    prefetch = prefetch or min(plan.num_shared_buffers, 8)
    return LayerwisePrefill(model, plan, pool, max_model_len=max_model_len, chunk_size=chunk_size,
                            prefetch_layers=prefetch, model_id=model_id, **kw)
