"""Shared layer buffers in vLLM's KV cache allocation: kvoffload's one change to vLLM internals.

Installed by the package's vLLM plugin (``kvoffload_vllm.plugin``) in every vLLM process, for vLLM
``shared_buffers.SUPPORTED_VLLM`` only (on another version nothing is changed and the store
connector refuses ``layerwise_num_shared_buffers`` with both versions named). It wraps two functions
of ``vllm.v1.core.kv_cache_utils``, which the engine core calls to size and lay out the KV cache:

``get_kv_cache_config_from_groups``  with a shared-buffer plan (``shared_buffers.plan_of``), vLLM
    sizes the cache for the plan's I + min(B, R) buffers, so the same memory budget holds
    N / (I + min(B, R)) times as many blocks, and every layer of a buffer gets a view of that one
    buffer (one ``KVCacheTensor`` per layer, at its buffer's offset; a DSA model's indexer caches
    likewise view their buffer's indexer descriptor). The scheduler's block pool
    and the workers' tensors both come from this config, so block accounting knows it. vLLM's
    device-side prefix caching is switched off (a block no longer holds every layer; prefix reuse
    comes from the host pool), and the seed's plan line is logged.
``_pool_bytes_per_block``  the bytes one block costs, for the same plan (vLLM's memory checks,
    ``num_gpu_blocks_override`` and the per-rank minimum use it).

Without a plan (another role, no ``layerwise_num_shared_buffers``, every layer independent) both
call vLLM's own function unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import structlog

from kvcore.config.names import STORE_CONNECTOR
from kvoffload_vllm.kv_groups import kv_groups
from kvoffload_vllm.shared_buffers import (
    SUPPORTED_VLLM,
    SharedBuffers,
    group_plan,
    requested_in,
    transfer_config_dict,
)

log = structlog.get_logger("vllm.kvoffload.shared_buffers")

_MARK = "__kvoffload_shared_buffers__"


def install() -> bool:
    """Wrap vLLM's KV cache sizing (idempotent); False (and nothing changed) on another vLLM."""
    import vllm
    from vllm.v1.core import kv_cache_utils as kcu

    if vllm.__version__ != SUPPORTED_VLLM:
        return False
    if getattr(kcu.get_kv_cache_config_from_groups, _MARK, False):
        return True
    config_from_groups, pool_bytes = kcu.get_kv_cache_config_from_groups, kcu._pool_bytes_per_block

    def get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, available_memory):
        shared = shared_plan(vllm_config, kv_cache_groups)
        if shared is None:
            return config_from_groups(vllm_config, kv_cache_groups, available_memory)
        config = config_from_groups(vllm_config, reduced(kv_cache_groups, shared), available_memory)
        if vllm_config.cache_config.enable_prefix_caching:
            vllm_config.cache_config.enable_prefix_caching = False
            log.info(
                "kvoffload_prefix_caching_off",
                reason="shared layer buffers: a device block holds one layer at a time; "
                "prefix reuse comes from the host pool",
            )
        shared.plan.log()
        log.info(
            "kvoffload_shared_buffers",
            layers=len(shared.layer_names),
            buffers=shared.plan.num_buffers,
            descriptors=shared.plan.num_descriptors_after,
            num_blocks=config.num_blocks,
            block_bytes=reduced(kv_cache_groups, shared)[0].kv_cache_spec.page_size_bytes,  # of every buffer
        )
        return expanded(config, kv_cache_groups, shared)

    def _pool_bytes_per_block(vllm_config, kv_cache_groups):
        shared = shared_plan(vllm_config, kv_cache_groups)
        return pool_bytes(vllm_config, kv_cache_groups if shared is None else reduced(kv_cache_groups, shared))

    for fn in (get_kv_cache_config_from_groups, _pool_bytes_per_block):
        setattr(fn, _MARK, True)
    kcu.get_kv_cache_config_from_groups = get_kv_cache_config_from_groups
    kcu._pool_bytes_per_block = _pool_bytes_per_block
    return True


def shared_plan(vllm_config, kv_cache_groups) -> SharedBuffers | None:
    """The plan for these groups, None without one; ConfigError for a cache the plan cannot take (the
    store connector's own rule, ``shared_buffers.group_plan``)."""
    kv = vllm_config.kv_transfer_config
    asked = None if kv is None else requested_in(transfer_config_dict(kv))
    if asked is None:
        return None
    groups = [g for g in kv_cache_groups if not getattr(g, "host_resident", False)]
    return group_plan(asked, kv_groups(groups, STORE_CONNECTOR))


def reduced(kv_cache_groups, shared: SharedBuffers) -> list:
    """The group as vLLM should size it: one cache per descriptor (the buffers' head caches)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    group = kv_cache_groups[0]
    heads = [n for n in group.layer_names if n in shared.viewers]  # vLLM's order
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = replace(spec, kv_cache_specs={n: spec.kv_cache_specs[n] for n in heads})
    return [replace(group, layer_names=heads, kv_cache_spec=spec)]


def expanded(config, kv_cache_groups, shared: SharedBuffers):
    """``config`` (sized for the head caches) with every cache viewing its buffer's bytes: the head's
    place in vLLM's ``KVCacheTensor`` (one per cache spec)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    tensors = [
        KVCacheTensor(
            size=t.size,
            layers=[name],
            layer_stride=t.layer_stride,
            block_stride=t.block_stride,
            offset=t.offset + i * t.layer_stride,
            host_resident=t.host_resident,
        )
        for t in config.kv_cache_tensors
        for i, head in enumerate(t.layers)
        for name in shared.viewers[head]
    ]
    return replace(config, kv_cache_tensors=tensors, kv_cache_groups=list(kv_cache_groups))
