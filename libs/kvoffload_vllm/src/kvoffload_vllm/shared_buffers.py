"""The seed's shared layer buffers on a vLLM prefill: which layers share which physical buffer.

A vLLM prefill (``kv_role: kv_producer``) whose AscendStoreConnector has ``use_layerwise: true``
and ``layerwise_num_shared_buffers: B`` keeps I + min(B, R) layers' worth of KV on the device
instead of N (``kvcore.plan.BufferPlan``: I independent layers, R reused ones round-robin over
min(B, R) buffers). This module turns vLLM's view of the model (layer names and one attention
spec) and its ``kv_transfer_config`` into that plan; ``kvoffload_vllm.kv_cache_patch`` applies it
to vLLM's KV cache allocation, the store connector (``kvoffload_vllm.store``) reloads and saves
each layer around its attention.

Pinned to the vLLM version whose allocation code the patch changes: another version is refused
at start-up with the version named (never a silently wrong cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from kvcore.config import parse_kv_transfer_config
from kvcore.configerrors import ConfigError
from kvcore.confignames import MULTI_CONNECTOR, STORE_CONNECTOR
from kvcore.connectorconfig import StoreConnectorConfig
from kvcore.layout import CacheSpec, KVLayout, LayerSpec, physical_index
from kvcore.nodeconfig import store_of
from kvcore.plan import BufferPlan
from kvcore.prefillsettings import resolve_independent_layers
from kvoffload_vllm.kv_groups import KVGroup

SUPPORTED_VLLM = "0.32.0"  # the KV cache allocation kvoffload_vllm.kv_cache_patch changes


@dataclass(frozen=True)
class SharedBuffers:
    """The plan over vLLM's layer names: ``layer_names`` in physical order, ``plan.slots`` of indices."""

    layer_names: tuple[str, ...]
    plan: BufferPlan

    @cached_property
    def previous_occupant(self) -> dict[str, str]:
        """Layer -> the layer that used its buffer before it: the one before it in the same slot, or
        for a slot's first layer the slot's last layer (the previous forward's last occupant)."""
        out = {}
        for members in self.plan.slots:
            if len(members) > 1:
                for i, layer in enumerate(members):
                    out[self.layer_names[layer]] = self.layer_names[members[i - 1]]
        return out

    @property
    def slot_heads(self) -> list[str]:
        """One layer per slot, in slot order: the layer whose tensor stands for the slot."""
        return [self.layer_names[members[0]] for members in self.plan.slots]

    def is_shared(self, layer_name: str) -> bool:
        return layer_name in self.previous_occupant


Request = tuple[int, Any]  # (B, the layerwise_independent_layers spec)


def requested(kv_role: str | None, store: StoreConnectorConfig | None) -> Request | None:
    """(B, independent-layer spec) when a kv_producer's store asks for shared buffers, else None."""
    if store is None or kv_role != "kv_producer":
        return None
    if not store.use_layerwise or store.layerwise_num_shared_buffers is None:
        return None
    return store.layerwise_num_shared_buffers, store.layerwise_independent_layers


def requested_in(kv_transfer_config: Mapping[str, Any]) -> Request | None:
    """``requested`` of a whole ``kv_transfer_config`` (the store alone or inside a MultiConnector).
    The plugin runs in every vLLM process: a config that names no AscendStoreConnector (vLLM's own
    connectors, another project's) is not ours to read, and a MultiConnector's other children are
    left to their own connectors."""
    config = dict(kv_transfer_config)
    if config.get("kv_connector") == MULTI_CONNECTOR:
        extra = dict(config.get("kv_connector_extra_config") or {})
        children = extra.get("connectors")
        ours = [c for c in children if _names_store(c)] if isinstance(children, list) else []
        if not ours:
            return None
        config["kv_connector_extra_config"] = {**extra, "connectors": ours}
    elif not _names_store(config):
        return None
    kv = parse_kv_transfer_config(config)
    found = store_of(kv)
    return requested(kv.kv_role, None if found is None else found[1])


def _names_store(config: object) -> bool:
    return isinstance(config, Mapping) and config.get("kv_connector") == STORE_CONNECTOR


def group_plan(asked: Request | None, groups: Sequence[KVGroup]) -> SharedBuffers | None:
    """``plan_of`` the model's one KV cache group, whose layers share one cache spec (a buffer holds any
    of its layers); ConfigError naming the key otherwise."""
    if asked is None:
        return None
    if len(groups) != 1 or any(s != groups[0].specs[0] for s in groups[0].specs):
        kinds = sorted({type(s).__name__ for g in groups for s in g.specs})
        raise ConfigError(
            [
                "kv_connector_extra_config.layerwise_num_shared_buffers: shared layer buffers inside vLLM take "
                f"one attention KV cache group of one cache spec; this model has {len(groups)} group(s) (block "
                f"sizes {[g.block_size for g in groups]}, specs {kinds}): drop the key, or start vLLM with "
                "--disable-hybrid-kv-cache-manager where the model allows it"
            ]
        )
    group, spec = groups[0], groups[0].specs[0]
    return plan_of(asked, list(group.layer_names), group.block_size, spec.page_size_bytes, spec.dtype)


def transfer_config_dict(kv) -> dict[str, Any]:
    """vLLM's ``KVTransferConfig`` as the plain dict kvcore's config models read."""
    return {
        "kv_connector": kv.kv_connector,
        "kv_role": kv.kv_role,
        "kv_connector_extra_config": dict(kv.kv_connector_extra_config or {}),
    }


def check_vllm_version(version: str) -> None:
    """Shared buffers change vLLM's KV cache allocation: only the version they were built on."""
    if version != SUPPORTED_VLLM:
        raise ConfigError(
            [
                f"kv_connector_extra_config.layerwise_num_shared_buffers: shared layer buffers inside vLLM "
                f"change its KV cache allocation and are built for vLLM {SUPPORTED_VLLM}; this is vLLM "
                f"{version}. Remove layerwise_num_shared_buffers (the store then runs on vLLM's full "
                f"cache) or install vllm {SUPPORTED_VLLM}"
            ]
        )


def check_eager(enforce_eager: bool) -> None:
    """The per-layer reload runs in Python around each layer's KV write: captured graphs would skip it
    (the seed's shared buffers are eager-mode only too)."""
    if not enforce_eager:
        raise ConfigError(
            [
                "kv_connector_extra_config.layerwise_num_shared_buffers: shared layer buffers need vLLM's "
                "eager mode (--enforce-eager): each layer's reload and reuse gate run in Python around its "
                "KV write, which a captured graph would skip"
            ]
        )


def plan_of(
    asked: Request | None,
    layer_names: Sequence[str],
    block_size: int,
    page_bytes: int,
    dtype: torch.dtype,
) -> SharedBuffers | None:
    """The shared-buffer plan of one uniform attention group for ``asked`` (``requested``), or None when
    not asked for or when every layer would keep its own buffer anyway."""
    if asked is None:
        return None
    num_shared, independent_spec = asked
    ordered = sorted(layer_names, key=lambda n: physical_index(n, len(layer_names)))
    indices = [physical_index(n, len(layer_names)) for n in ordered]
    if indices != list(range(len(ordered))):
        raise ConfigError([f"layerwise_num_shared_buffers: vLLM's layer names {list(ordered)} do not number 0..N-1"])
    width = page_bytes // block_size // dtype.itemsize
    spec = CacheSpec(width, dtype, page_bytes // block_size - width * dtype.itemsize)
    layout = KVLayout(tuple(LayerSpec(i, n, spec) for i, n in enumerate(ordered)), len(ordered), block_size)
    independent = resolve_independent_layers(
        independent_spec, layout.num_layers, field="kv_connector_extra_config.layerwise_independent_layers"
    )
    plan = BufferPlan.build(layout, num_shared, independent)
    if not plan.reuses:
        return None
    return SharedBuffers(tuple(ordered), plan)


def check_caches(shared: SharedBuffers, caches: Mapping[str, torch.Tensor]) -> None:
    """The worker's caches are laid out as the plan says: layers of one slot on one buffer, slots
    on distinct buffers. Anything else (vLLM allocated one buffer per layer) is refused."""
    ptr = {name: caches[name].data_ptr() for name in shared.layer_names}
    for members in shared.plan.slots:
        names = [shared.layer_names[i] for i in members]
        if len({ptr[n] for n in names}) != 1:
            raise ConfigError(
                [
                    f"layerwise_num_shared_buffers: layers {names} should share one KV buffer but vLLM "
                    "allocated them apart (the kvoffload_vllm plugin did not change vLLM's KV cache "
                    "allocation: is the kvoffload-vllm package installed in this environment?)"
                ]
            )
    heads = [ptr[n] for n in shared.slot_heads]
    if len(set(heads)) != len(heads):
        raise ConfigError(["layerwise_num_shared_buffers: two buffers of the plan share one KV tensor"])
