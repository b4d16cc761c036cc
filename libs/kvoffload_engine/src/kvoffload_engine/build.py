"""Constructors that wire a model to kvcore: host pools and the prefill engine from plain settings."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from dsamodel.served import ServedModel
from kvcore.plan import BufferPlan
from kvcore.pool.eviction import LRUEviction, NoEviction
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import HostPoolBackend
from kvcore.pool.local import LocalHostPool
from kvoffload_engine.model_layout import kv_layout
from kvoffload_engine.prefill import LayerwisePrefill


def _name(prefix: str, name: str | None) -> str:
    return name or f"{prefix}-{uuid.uuid4().hex[:12]}"


def prefill_geometry(model: ServedModel, block_size: int, capacity_bytes: int) -> PoolGeometry:
    """The prefill side's pool geometry: main + indexer planes of every layer."""
    return PoolGeometry.from_layout(
        kv_layout(model.config, block_size, model.dtype), capacity_bytes, include_indexer=True
    )


def prefill_pool(model: ServedModel, block_size: int, capacity_bytes: int, name: str | None = None) -> LocalHostPool:
    """The prefill side's host pool, indexed in this process, with an LRU prefix cache."""
    return LocalHostPool.create(
        _name("kvoffload-prefill", name), prefill_geometry(model, block_size, capacity_bytes), eviction=LRUEviction()
    )


def decode_geometry(model: ServedModel, block_size: int, capacity_bytes: int) -> PoolGeometry:
    """The decode side's pool geometry: main planes only (the indexer stays on device)."""
    return PoolGeometry.from_layout(
        kv_layout(model.config, block_size, model.dtype), capacity_bytes, include_indexer=False
    )


def decode_pool(model: ServedModel, block_size: int, capacity_bytes: int, name: str | None = None) -> LocalHostPool:
    """The decode side's host pool (``decode_geometry``); never evicts."""
    return LocalHostPool.create(
        _name("kvoffload-decode", name), decode_geometry(model, block_size, capacity_bytes), eviction=NoEviction()
    )


def prefill_engine(
    model: ServedModel,
    pool: HostPoolBackend,
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
    indep: Iterable[int]
    if independent == "all":
        indep = range(n)
    elif isinstance(independent, str):
        raise TypeError(f"independent: got {independent!r}; must be 'all' or layer indices")
    else:
        indep = sorted({i % n for i in independent})
    plan = BufferPlan.build(layout, buffers, indep)
    prefetch = prefetch or min(plan.num_shared_buffers, 8)
    return LayerwisePrefill(
        model,
        plan,
        pool,
        max_model_len=max_model_len,
        chunk_size=chunk_size,
        prefetch_layers=prefetch,
        model_id=model_id,
        **kw,
    )
