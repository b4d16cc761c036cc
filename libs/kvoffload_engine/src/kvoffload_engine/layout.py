"""The kvcore ``KVLayout`` of a DSA model config (MTP layers after the base layers)."""

from __future__ import annotations

import torch

from dsamodel.config import ModelConfig
from dsamodel.indexcodec import indexer_cache_format
from kvcore.layout import KVLayout


def kv_layout(config: ModelConfig, block_size: int, dtype: torch.dtype | None = None) -> KVLayout:
    """Main latent cache (kv_lora_rank + rope) in ``dtype`` and indexer keys per layer: in ``dtype``,
    or fp8 plus scales where the config's indexer cache is fp8 (``dsamodel.indexcodec``)."""
    fmt = indexer_cache_format(config)
    fp8 = fmt.scale_bytes > 0
    return KVLayout.for_mla(
        num_hidden_layers=config.num_hidden_layers,
        kv_lora_rank=config.kv_lora_rank,
        qk_rope_head_dim=config.qk_rope_head_dim,
        block_size=block_size,
        dtype=dtype or config.dtype,
        num_mtp_layers=config.num_nextn_predict_layers,
        index_head_dim=config.index_head_dim,
        index_dtype=fmt.dtype if fp8 else None,
        index_scale_bytes=fmt.scale_bytes,
    )
