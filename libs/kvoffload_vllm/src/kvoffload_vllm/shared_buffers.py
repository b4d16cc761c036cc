"""The seed's shared layer buffers on a vLLM prefill: which layers share which physical buffer.

A vLLM prefill (``kv_role: kv_producer``) whose AscendStoreConnector has ``use_layerwise: true``
and ``layerwise_num_shared_buffers: B`` keeps I + min(B, R) layers' worth of KV on the device
instead of N (``kvcore.plan.BufferPlan``: I independent layers, R reused ones round-robin over
min(B, R) buffers). This module turns vLLM's view of the model (its one KV cache group's caches)
and its ``kv_transfer_config`` into that plan; ``kvoffload_vllm.kv_cache_patch`` applies it
to vLLM's KV cache allocation, the store connector (``kvoffload_vllm.store``) reloads and saves
each layer around its attention.

A DSA model (DeepSeek-V3.2, GLM-5) gives vLLM one group whose layers each hold two caches: the
attention's latent cache (``...self_attn.attn``) and the lightning indexer's key cache
(``...self_attn.indexer.k_cache``, vLLM's ``cache_role`` "indexer"). As in the seed, a buffer is
one main descriptor plus one indexer descriptor (the widest indexer of its layers), the plan line
counts every cache (``merged 2N descriptors into 2S``), and MTP layers (vLLM numbers them after
the base layers: ``model.layers.<num_hidden_layers>``) are planned like any other layer.

Pinned to the vLLM version whose allocation code the patch changes: another version is refused
at start-up with the version named (never a silently wrong cache).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from kvcore.config.connectors import StoreConnectorConfig
from kvcore.config.errors import ConfigError
from kvcore.config.names import MULTI_CONNECTOR, STORE_CONNECTOR
from kvcore.config.node import store_of
from kvcore.config.parse import parse_kv_transfer_config
from kvcore.config.prefill_settings import resolve_independent_layers
from kvcore.layout import CacheSpec, KVLayout, LayerSpec, physical_index
from kvcore.plan import BufferPlan
from kvoffload_vllm.kv_groups import KVGroup

SUPPORTED_VLLM = "0.32.0"  # the KV cache allocation kvoffload_vllm.kv_cache_patch changes


@dataclass(frozen=True)
class SharedBuffers:
    """The plan over vLLM's layer names: ``layer_names`` (the attention layers, whose caches are the
    main ones) in physical order, ``plan.slots`` of indices; ``indexer_names[i]``: layer i's indexer
    cache, None without one."""

    layer_names: tuple[str, ...]
    plan: BufferPlan
    indexer_names: tuple[str | None, ...] = ()

    def caches(self, layer_name: str) -> tuple[str, ...]:
        """Every cache of an attention layer: its own, then its indexer's where it has one."""
        indexer = self._indexer_of.get(layer_name)
        return (layer_name,) if indexer is None else (layer_name, indexer)

    @cached_property
    def _indexer_of(self) -> dict[str, str]:
        return {n: i for n, i in zip(self.layer_names, self.indexer_names, strict=False) if i is not None}

    @cached_property
    def viewers(self) -> dict[str, tuple[str, ...]]:
        """Buffer head cache -> every cache that views its bytes (itself first): a slot's main caches
        view its first layer's, its indexer caches the widest indexer's (the plan's descriptors)."""
        out: dict[str, tuple[str, ...]] = {}
        for d in self.plan.descriptors:
            names = [self.layer_names[i] for i in d.layers]
            if d.kind == "indexer":
                names = [self._indexer_of[n] for n in names if n in self._indexer_of]
                widest = max(d.layers, key=lambda i: self._row_bytes(i))
                names.remove(head := self._indexer_of[self.layer_names[widest]])
                names.insert(0, head)
            out[names[0]] = tuple(names)
        return out

    def _row_bytes(self, layer: int) -> int:
        spec = self.plan.layout.layers[layer].indexer
        return -1 if spec is None else spec.row_bytes

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
    """``plan_of`` the model's one KV cache group: its attention layers' caches of one page size (a
    buffer holds any of its layers), each with at most one indexer cache (vLLM's ``cache_role``
    "indexer": a DSA model's); ConfigError naming the key otherwise."""
    if asked is None:
        return None
    mains = dict(zip(groups[0].layer_names, groups[0].specs, strict=True)) if len(groups) == 1 else {}
    indexers = {n: mains.pop(n) for n in list(mains) if getattr(mains[n], "cache_role", None) == "indexer"}
    first = next(iter(mains.values()), None)
    if first is None or len({(s.page_size_bytes, s.dtype) for s in mains.values()}) > 1:
        kinds = sorted({type(s).__name__ for g in groups for s in g.specs})
        raise ConfigError(
            [
                "kv_connector_extra_config.layerwise_num_shared_buffers: shared layer buffers inside vLLM take "
                "one attention KV cache group of one cache spec (a DSA model's indexer caches beside it); this "
                f"model has {len(groups)} group(s) (block sizes {[g.block_size for g in groups]}, specs {kinds}"
                f"{_page_sizes(mains) if len(groups) == 1 else ''}): drop the key, or start vLLM with "
                "--disable-hybrid-kv-cache-manager where the model allows it (not DeepSeek-V4: its "
                "sliding-window and compressor-state caches need groups of their own)"
            ]
        )
    pages = {n: (s.page_size_bytes, s.dtype) for n, s in indexers.items()}
    return plan_of(asked, list(mains), groups[0].block_size, first.page_size_bytes, first.dtype, pages)


def _page_sizes(specs: Mapping[str, Any]) -> str:
    return f", attention page bytes {sorted({s.page_size_bytes for s in specs.values()})}"


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
    indexers: Mapping[str, tuple[int, torch.dtype]] | None = None,
) -> SharedBuffers | None:
    """The shared-buffer plan of one uniform attention group for ``asked`` (``requested``), or None when
    not asked for or when every layer would keep its own buffer anyway. ``indexers``: indexer cache
    name -> (page bytes, dtype), each the indexer of the attention layer of its layer index."""
    if asked is None:
        return None
    num_shared, independent_spec = asked
    n = len(layer_names)
    ordered = sorted(layer_names, key=lambda name: physical_index(name, n))
    if [physical_index(name, n) for name in ordered] != list(range(n)):
        raise ConfigError([f"layerwise_num_shared_buffers: vLLM's layer names {list(ordered)} do not number 0..N-1"])
    by_layer = _indexers_by_layer(indexers or {}, ordered)
    main = _cache_spec(page_bytes, block_size, dtype)
    layers = []
    for i, name in enumerate(ordered):
        page, dtype_of = by_layer[i][1] if i in by_layer else (0, None)
        layers.append(LayerSpec(i, name, main, None if dtype_of is None else _cache_spec(page, block_size, dtype_of)))
    layout = KVLayout(tuple(layers), n, block_size)
    independent = resolve_independent_layers(
        independent_spec, layout.num_layers, field="kv_connector_extra_config.layerwise_independent_layers"
    )
    plan = BufferPlan.build(layout, num_shared, independent)
    if not plan.reuses:
        return None
    names = tuple(by_layer[i][0] if i in by_layer else None for i in range(n))
    return SharedBuffers(tuple(ordered), plan, names)


def _indexers_by_layer(
    indexers: Mapping[str, tuple[int, torch.dtype]], ordered: Sequence[str]
) -> dict[int, tuple[str, tuple[int, torch.dtype]]]:
    """Layer index -> (indexer cache name, its page bytes and dtype); ConfigError for an indexer cache
    of no attention layer, or two of one."""
    out: dict[int, tuple[str, tuple[int, torch.dtype]]] = {}
    for name, page in indexers.items():
        i = physical_index(name, len(ordered))
        if not 0 <= i < len(ordered) or i in out:
            owner = "no attention layer" if not 0 <= i < len(ordered) else f"layer {ordered[i]!r}, beside {out[i][0]!r}"
            raise ConfigError([f"layerwise_num_shared_buffers: vLLM's indexer cache {name!r} belongs to {owner}"])
        out[i] = (name, page)
    return out


def _cache_spec(page_bytes: int, block_size: int, dtype: torch.dtype) -> CacheSpec:
    """A cache's bytes per token as the plan counts them (elements of ``dtype``, the rest as scale bytes)."""
    row = page_bytes // block_size
    width = row // dtype.itemsize
    return CacheSpec(width, dtype, row - width * dtype.itemsize)


def check_caches(shared: SharedBuffers, caches: Mapping[str, torch.Tensor]) -> None:
    """The worker's caches are laid out as the plan says: the caches of one buffer (its layers' main
    caches; their indexer caches) on one tensor, buffers on distinct tensors. Anything else (vLLM
    allocated one buffer per layer) is refused."""
    ptr = {name: caches[name].data_ptr() for names in shared.viewers.values() for name in names}
    for names in shared.viewers.values():
        if len({ptr[n] for n in names}) != 1:
            raise ConfigError(
                [
                    f"layerwise_num_shared_buffers: caches {list(names)} should share one KV buffer but vLLM "
                    "allocated them apart (the kvoffload_vllm plugin did not change vLLM's KV cache "
                    "allocation: is the kvoffload-vllm package installed in this environment?)"
                ]
            )
    heads = [ptr[n] for n in shared.viewers]
    if len(set(heads)) != len(heads):
        raise ConfigError(["layerwise_num_shared_buffers: two buffers of the plan share one KV tensor"])
