"""How indexer keys are stored in caches: the format (``indexer_cache_format``) and ``IndexCodec``.

The format is the serving engine's, read from ``config.json`` alone: for ``DeepseekV32ForCausalLM``
(``architectures``) the keys are float8_e4m3fn plus one float32 scale per 128-element block
(DeepSeek-V3.2's indexer: 128 key bytes + 4 scale bytes per token at ``index_head_dim`` 128); for
any other architecture, ``torch_dtype`` and no scale. ``kvoffload plan`` sizes the cache from it
and reports it (``IndexerCacheFormat.describe``).

Plain (most configs): rows of ``index_head_dim`` elements in the model dtype, stored as computed.
fp8 (``indexer_cache_format`` says so: DeepSeek-V3.2's ``DeepseekV32ForCausalLM``, and the
tiny preset with ``fp8_indexer``): each key is scaled per 128-element block by ``amax / 448`` (the
largest float8_e4m3fn value), cast to float8_e4m3fn, and stored as one uint8 row of
``index_head_dim`` key bytes followed by one float32 scale per block (132 bytes at
``index_head_dim`` 128). Every holder of indexer rows (prefill layer buffers, host pools, the P→D
pull, the decode's device cache) stores ``encode(index_k)`` rows and moves them as bytes; the
indexer scores ``decode(rows)`` (float32 for fp8), so all paths select from the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsamodel.config import ModelConfig
from dsamodel.llama_config import LlamaConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_INDEXER_ARCHITECTURES = ("DeepseekV32ForCausalLM",)
INDEX_SCALE_BLOCK = 128  # elements per float32 scale of an fp8 indexer key (DeepSeek-V3.2)


@dataclass(frozen=True)
class IndexerCacheFormat:
    """How one token's indexer key is stored: ``dtype`` elements, plus ``scale_bytes`` of scales
    (one float32 per ``scale_block`` elements; none when 0), and why (``source``)."""

    dtype: torch.dtype
    key_bytes: int
    scale_bytes: int
    scale_block: int | None
    source: str

    @property
    def row_bytes(self) -> int:
        return self.key_bytes + self.scale_bytes

    def describe(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "key_bytes": self.key_bytes,
            "scale_bytes": self.scale_bytes,
            "scale_dtype": "float32" if self.scale_bytes else None,
            "scale_block": self.scale_block,
            "row_bytes": self.row_bytes,
            "source": self.source,
        }


def indexer_cache_format(config: ModelConfig | LlamaConfig) -> IndexerCacheFormat:
    """The indexer cache format of ``config`` (module docstring); ValueError for a Llama config whose
    indexer was never built."""
    width = config.index_head_dim
    if width is None:
        raise ValueError("the model has no indexer, so no indexer cache (a Llama model's is built beside its weights)")
    fp8 = next((a for a in config.architectures if a in FP8_INDEXER_ARCHITECTURES), None)
    if fp8 is not None:
        blocks = -(-width // INDEX_SCALE_BLOCK)
        return IndexerCacheFormat(
            torch.float8_e4m3fn,
            width,
            4 * blocks,
            INDEX_SCALE_BLOCK,
            f"architectures {fp8}: the serving engines store its indexer keys as float8_e4m3fn with one "
            f"float32 scale per {INDEX_SCALE_BLOCK}-element block",
        )
    return IndexerCacheFormat(
        config.dtype,
        width * config.dtype.itemsize,
        0,
        None,
        f"torch_dtype {config.torch_dtype} (architectures {list(config.architectures)}: no fp8 indexer cache)",
    )


class IndexCodec:
    """The storage of one model's indexer keys (module docstring)."""

    def __init__(self, config: ModelConfig | LlamaConfig) -> None:
        fmt = indexer_cache_format(config)  # ValueError without an indexer
        self.width: int = config.index_head_dim or 0
        self.fp8 = fmt.dtype == FP8
        self.block = fmt.scale_block or 0
        self.num_blocks = -(-self.width // self.block) if self.fp8 else 0
        self.row_bytes = fmt.row_bytes if self.fp8 else None

    def storage(self, dtype: torch.dtype) -> tuple[torch.dtype, int]:
        """(dtype, width) of a tensor of indexer rows, for a model computing in ``dtype``."""
        if self.row_bytes is not None:  # set exactly when the keys are stored as fp8 rows
            return torch.uint8, self.row_bytes
        return dtype, self.width

    def encode(self, keys: torch.Tensor) -> torch.Tensor:
        """[T, Di] keys -> [T, storage width] rows to store (plain: the keys themselves)."""
        if not self.fp8:
            return keys
        t = keys.shape[0]
        padded = torch.zeros((t, self.num_blocks * self.block), dtype=torch.float32, device=keys.device)
        padded[:, : self.width] = keys.to(torch.float32)
        blocks = padded.view(t, self.num_blocks, self.block)  # [T, nb, 128]
        scale = blocks.abs().amax(-1).clamp(min=1e-12) / FP8_MAX  # [T, nb]
        q = (blocks / scale[..., None]).to(FP8).view(t, -1)[:, : self.width]  # [T, Di]
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8).view(t, 4 * self.num_blocks)], dim=1)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., storage width] stored rows -> [..., Di] keys (fp8: float32, dequantized)."""
        if not self.fp8:
            return rows
        lead = rows.shape[:-1]
        q = rows[..., : self.width].contiguous().view(FP8).to(torch.float32)  # [..., Di]
        scale = rows[..., self.width :].contiguous().view(torch.float32)  # [..., nb]
        per_element = scale.repeat_interleave(self.block, dim=-1)[..., : self.width]  # [..., Di]
        return (q * per_element).reshape(*lead, self.width)
