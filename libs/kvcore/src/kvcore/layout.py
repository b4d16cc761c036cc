"""Per-layer KV cache specs of a sparse-attention model.

A model has ``num_base_layers`` decoder layers followed by ``num_mtp_layers`` MTP layers; every
layer owns one main cache and, optionally, an indexer key cache (``index_head_dim`` elements, plus a
per-token scale when the keys are quantized). Physical layer indices number base layers first, then
MTP layers. The main cache's row is one of ``ROW_KINDS``:

- ``"mla_latent"``: an MLA model's compressed latent (``kv_lora_rank + qk_rope_head_dim`` elements
  per token; DeepSeek-V3.2 / GLM-5, ``KVLayout.for_mla``);
- ``"k_v"``: K of every KV head (RoPE'd), then V of every KV head (``2 x num_key_value_heads x
  head_dim`` elements per token; a GQA model such as Llama, ``KVLayout.for_gqa``).

Everything that moves rows (the plan, the host pool, the P->D pull, the hot cache) treats both
alike: rows of ``row_bytes``; the kind says what they hold, so two sides that would read each other's
rows can check they mean the same thing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_MTP_RE = re.compile(r"(?:^|\.)mtp\.(?:layers\.)?(\d+)(?:\.|$)")
_LAYERS_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_INT_RE = re.compile(r"\d+")

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"``/``"float32"``/... (or a torch dtype) -> torch dtype; ValueError otherwise."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype {name} is not supported; use one of {sorted(_DTYPES)}")
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The name ``parse_dtype`` accepts for ``dtype`` (how layouts name dtypes on the wire)."""
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(_DTYPES)}")


def physical_index(cache_name: str, num_base_layers: int) -> int:
    """Physical layer index of a cache name.

    ``...mtp.N`` / ``...mtp.layers.N`` -> ``num_base_layers + N``; ``...layers.N`` -> ``N``;
    otherwise the first integer in the name. A main cache and its ``.indexer.k_cache`` share it.
    """
    if num_base_layers < 0:
        raise ValueError(f"num_base_layers must be >= 0, got {num_base_layers}")
    m = _MTP_RE.search(cache_name)
    if m:
        return num_base_layers + int(m.group(1))
    m = _LAYERS_RE.search(cache_name)
    if m:
        return int(m.group(1))
    m = _INT_RE.search(cache_name)
    if m:
        return int(m.group(0))
    raise ValueError(f"cache name {cache_name!r} has no layer index (expected 'layers.N', 'mtp.N' or an integer)")


ROW_KINDS = ("mla_latent", "k_v")  # what a main cache's row holds (module docstring)


@dataclass(frozen=True)
class CacheSpec:
    """One cache of one layer, per token: ``width`` elements of ``dtype`` (+ optional scale bytes);
    a main cache's ``kind`` is one of ``ROW_KINDS`` (an indexer cache keeps the default)."""

    width: int
    dtype: torch.dtype
    scale_bytes: int = 0
    kind: str = "mla_latent"

    def __post_init__(self) -> None:
        if self.width <= 0:
            raise ValueError(f"cache width must be > 0, got {self.width}")
        if self.scale_bytes < 0:
            raise ValueError(f"scale_bytes must be >= 0, got {self.scale_bytes}")
        if self.kind not in ROW_KINDS:
            raise ValueError(f"cache row kind must be one of {ROW_KINDS}, got {self.kind!r}")

    @property
    def row_bytes(self) -> int:
        """Bytes of one token row."""
        return self.width * self.dtype.itemsize + self.scale_bytes

    @property
    def storage(self) -> tuple[torch.dtype, int]:
        """(dtype, width) of a tensor holding these rows: ``(dtype, width)``, or for fp8 elements or
        rows with scale bytes ``(uint8, row_bytes)`` (the rows are moved as bytes)."""
        if self.scale_bytes or self.dtype.itemsize == 1:
            return torch.uint8, self.row_bytes
        return self.dtype, self.width


@dataclass(frozen=True)
class LayerSpec:
    """The caches of one physical layer."""

    index: int
    name: str
    main: CacheSpec
    indexer: CacheSpec | None = None

    @property
    def is_mtp(self) -> bool:
        return ".mtp." in f".{self.name}."

    @property
    def row_bytes(self) -> int:
        """Bytes per token over all caches of this layer."""
        return self.main.row_bytes + (self.indexer.row_bytes if self.indexer else 0)

    @property
    def num_caches(self) -> int:
        return 1 + (self.indexer is not None)


@dataclass(frozen=True)
class KVLayout:
    """Every cache layer of a model, in physical order, with the paging block size."""

    layers: tuple[LayerSpec, ...]
    num_base_layers: int
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if [layer.index for layer in self.layers] != list(range(len(self.layers))):
            raise ValueError("layers must be numbered 0..N-1 in physical order")
        if not 0 <= self.num_base_layers <= len(self.layers):
            raise ValueError(f"num_base_layers {self.num_base_layers} outside 0..{len(self.layers)}")

    @classmethod
    def for_mla(
        cls,
        *,
        num_hidden_layers: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        block_size: int,
        dtype: str | torch.dtype = "bfloat16",
        num_mtp_layers: int = 0,
        index_head_dim: int | None = None,
        index_dtype: str | torch.dtype | None = None,
        index_scale_bytes: int = 0,
    ) -> KVLayout:
        """The layout of an MLA model (DeepSeek-V3.2 / GLM-5 style), MTP layers after base layers."""
        main = CacheSpec(kv_lora_rank + qk_rope_head_dim, parse_dtype(dtype), kind="mla_latent")
        indexer = (
            CacheSpec(index_head_dim, parse_dtype(index_dtype or dtype), index_scale_bytes) if index_head_dim else None
        )
        return cls._of(main, indexer, num_hidden_layers, num_mtp_layers, block_size)

    @classmethod
    def for_gqa(
        cls,
        *,
        num_hidden_layers: int,
        num_key_value_heads: int,
        head_dim: int,
        block_size: int,
        dtype: str | torch.dtype = "bfloat16",
        index_head_dim: int | None = None,
        index_dtype: str | torch.dtype | None = None,
    ) -> KVLayout:
        """The layout of a GQA model (Llama style): a row of K then V of every KV head per token and
        layer, with the indexer keys of an indexer built for it; no MTP layers."""
        if num_key_value_heads <= 0 or head_dim <= 0:
            raise ValueError(f"num_key_value_heads and head_dim must be > 0, got {num_key_value_heads}, {head_dim}")
        main = CacheSpec(2 * num_key_value_heads * head_dim, parse_dtype(dtype), kind="k_v")
        indexer = CacheSpec(index_head_dim, parse_dtype(index_dtype or dtype)) if index_head_dim else None
        return cls._of(main, indexer, num_hidden_layers, 0, block_size)

    @classmethod
    def _of(
        cls, main: CacheSpec, indexer: CacheSpec | None, num_hidden_layers: int, num_mtp_layers: int, block_size: int
    ) -> KVLayout:
        if num_hidden_layers <= 0:
            raise ValueError(f"num_hidden_layers must be > 0, got {num_hidden_layers}")
        if num_mtp_layers < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got {num_mtp_layers}")
        layers = []
        for i in range(num_hidden_layers + num_mtp_layers):
            name = f"model.layers.{i}" if i < num_hidden_layers else f"model.mtp.{i - num_hidden_layers}"
            layers.append(LayerSpec(i, name, main, indexer))
        return cls(tuple(layers), num_hidden_layers, block_size)

    @property
    def num_layers(self) -> int:
        """Physical layer count, MTP layers included."""
        return len(self.layers)

    @property
    def num_mtp_layers(self) -> int:
        return len(self.layers) - self.num_base_layers

    @property
    def has_indexer(self) -> bool:
        return any(layer.indexer is not None for layer in self.layers)

    @property
    def main_bytes_per_token(self) -> int:
        """Main-cache bytes of one token over every layer (what a decode host pool holds)."""
        return sum(layer.main.row_bytes for layer in self.layers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token over every cache of every layer."""
        return sum(layer.row_bytes for layer in self.layers)

    def cache_names(self) -> list[str]:
        """One name per logical cache (main, then indexer), as an engine registers them."""
        names = []
        for layer in self.layers:
            names.append(layer.name)
            if layer.indexer is not None:
                names.append(f"{layer.name}.indexer.k_cache")
        return names
