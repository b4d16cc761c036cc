"""The key prefix that keeps layouts apart, and one contiguous KV cache group's layout.

A vLLM worker hands the connector one tensor per attention layer whose first dimension is the
block: ``cache[b]`` is block b of that layer (on CPU ``[num_blocks, num_kv_heads, 2 * block_size,
head_size]``-like; the order inside a block is the backend's business). A block is copied byte for
byte, so it goes back into any engine with the same layout unchanged; the layout's digest (and, with
several KV cache groups, the group's) is part of every block key, so engines whose layouts differ
never read each other's blocks. ``CacheLayout`` is the one contiguous group the shared layer buffers
take (the store and the D2H connector take any groups: ``kvoffload_vllm.group_caches``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvoffload_vllm.kv_groups import KVGroup


class LayoutMismatch(ValueError):
    """A cache is not laid out as the connector needs; the message names the layer and both sides."""


def model_key_prefix(model_name: str, layout: Mapping[str, object]) -> str:
    """The block keys' model id: the served model name and a digest of everything that decides the
    bytes of a block (``layout``: spec fields, device type, vLLM version, layer names)."""
    digest = hashlib.sha256(json.dumps(layout, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"vllm:{model_name}:{digest}"


def vllm_model_id(
    vllm_config, spec, layer_order: Sequence[str], layer_specs: Sequence[object] = (), head_shards: int = 1
) -> str:
    """``model_key_prefix`` of a vLLM engine: its served model name and the attention spec, device
    type, vLLM version and layer names that decide a block's bytes (imports vLLM). ``layer_specs``:
    each layer's spec where a KV cache group mixes them (a hybrid KV cache's groups). ``head_shards``:
    the ranks the spec's KV heads are one slice of (a TP rank's), so the id is the whole model's,
    the same for engines of any TP that hold all the heads together."""
    import vllm
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    fields = {
        "spec": type(spec).__name__,
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads * head_shards,
        "head_size": spec.head_size,
        "dtype": str(spec.dtype),
        "page_bytes": spec.page_size_bytes * head_shards,
        "device": current_platform.device_type,
        "vllm": vllm.__version__,
        "layers": list(layer_order),
    }
    if layer_specs:
        fields["layer_specs"] = [repr(s) for s in layer_specs]
    return model_key_prefix(str(model.served_model_name or model.model), fields)


def group_model_ids(vllm_config, groups: Sequence[KVGroup], head_shards: int = 1) -> list[str]:
    """The block keys' model id of each KV cache group: with several, each layer's spec and the group's
    index are in it too, so no two groups' keys meet (imports vLLM); ``head_shards`` as
    ``vllm_model_id``'s."""
    if len(groups) == 1:
        return [vllm_model_id(vllm_config, groups[0].specs[0], groups[0].layer_names, head_shards=head_shards)]
    return [f"{vllm_model_id(vllm_config, g.specs[0], g.layer_names, g.specs, head_shards)}:g{g.index}" for g in groups]


@dataclass(frozen=True)
class CacheLayout:
    """The attention layers' caches in layer order: name, block shape and dtype, bytes per block."""

    layer_names: tuple[str, ...]
    num_blocks: int
    block_size: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer."""
        n = 1
        for d in self.block_shape:
            n *= d
        return n * self.dtype.itemsize

    def plane(self, layer_name: str) -> int:
        return self.layer_names.index(layer_name)

    @classmethod
    def of(
        cls, caches: Mapping[str, object], order: Sequence[str], num_blocks: int, block_size: int, page_bytes: int
    ) -> CacheLayout:
        """Check vLLM's per-layer caches (``order``: layer order) and describe them.

        Every layer must be one contiguous tensor ``[num_blocks, ...]`` whose block is
        ``page_bytes`` (the KV cache spec's page size), all with one shape and dtype; anything else
        is refused with the layer and what was expected.
        """
        missing = [n for n in order if n not in caches]
        if missing or len(order) != len(caches):
            raise LayoutMismatch(
                f"vLLM registered caches for {sorted(caches)}, the KV cache config names {list(order)}"
            )
        first: tuple[tuple[int, ...], torch.dtype] | None = None
        for name in order:
            t = caches[name]
            if not isinstance(t, torch.Tensor):
                raise LayoutMismatch(
                    f"layer {name!r}: the connector needs one tensor per layer, got {type(t).__name__}"
                )
            if t.dim() < 2 or t.shape[0] != num_blocks or not t.is_contiguous():
                raise LayoutMismatch(
                    f"layer {name!r}: needs a contiguous [num_blocks={num_blocks}, ...] tensor, got "
                    f"shape {list(t.shape)} (contiguous: {t.is_contiguous()})"
                )
            got = (tuple(t.shape[1:]), t.dtype)
            if first is None:
                first = got
            elif got != first:
                raise LayoutMismatch(
                    f"layer {name!r}: block {list(got[0])} {got[1]} differs from layer "
                    f"{order[0]!r}'s {list(first[0])} {first[1]}"
                )
        if first is None:
            raise LayoutMismatch("vLLM registered no KV cache layer")
        layout = cls(tuple(order), num_blocks, block_size, first[0], first[1])
        if layout.block_bytes != page_bytes:
            raise LayoutMismatch(
                f"a block of layer {order[0]!r} is {layout.block_bytes} bytes, the KV cache spec says {page_bytes}"
            )
        return layout
