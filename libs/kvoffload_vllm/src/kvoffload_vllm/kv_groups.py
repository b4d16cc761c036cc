"""vLLM's KV cache groups as the connectors handle them: each group's layers, block size and layer specs.

A full-attention model (MLA included) has one group. With vLLM's hybrid KV cache manager on
(``SupportsHMA`` connectors) a model with sliding-window and full-attention layers has one group per
kind, and a DeepSeek-V4 model five, of block sizes 64/256/4/8 tokens. Each group has its own block
table and block size: a layer's blocks are its group's. The groups share one block pool — a block id
belongs to one group at a time, which is why layers of different groups may be views of the same
memory — and a sliding-window group's blocks that fell out of the window are vLLM's null block
(``NULL_BLOCK``), which is never read or written. Only attention caches are handled (full, sliding
window, MLA, their per-layer mixes); a Mamba state group is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import lcm
from typing import TYPE_CHECKING, Any

from kvcore.config.errors import ConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

NULL_BLOCK = 0  # vLLM's BlockPool takes block 0 as its null block (padding of skipped blocks)


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its index, layers (in vLLM's order), block size in tokens, and each layer's spec."""

    index: int
    layer_names: tuple[str, ...]
    block_size: int
    specs: tuple[Any, ...]  # vLLM AttentionSpec per layer (the bytes of a block)


def kv_groups(kv_cache_groups: Sequence[KVCacheGroupSpec], connector: str) -> tuple[KVGroup, ...]:
    """vLLM's ``kv_cache_groups`` (a ``KVCacheConfig``'s); ConfigError naming ``connector`` for a group
    that holds a cache other than attention (a Mamba state)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

    out = []
    for i, group in enumerate(kv_cache_groups):
        spec = group.kv_cache_spec
        per_layer = (
            dict(spec.kv_cache_specs)
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else dict.fromkeys(group.layer_names, spec)
        )
        other = {name: type(s).__name__ for name, s in per_layer.items() if not isinstance(s, AttentionSpec)}
        if other:
            raise ConfigError([f"{connector}: saves attention KV caches only; KV cache group {i} holds {other}"])
        names = tuple(group.layer_names)
        out.append(KVGroup(i, names, spec.block_size, tuple(per_layer[n] for n in names)))
    if not out:
        raise ConfigError([f"{connector}: the model has no KV cache group"])
    return tuple(out)


def hit_unit(groups: tuple[KVGroup, ...]) -> int:
    """Tokens a hit is a multiple of: every group's blocks whole (the least common multiple of the block sizes)."""
    return lcm(*(g.block_size for g in groups))


def skip_null(block_ids: Sequence[int]) -> int:
    """How many of ``block_ids`` lead with vLLM's null block (a sliding window's skipped blocks, always
    the first ones): nothing to load into or save from."""
    return next((i for i, b in enumerate(block_ids) if b != NULL_BLOCK), len(block_ids))
