"""The kvcore ``KVLayout`` of a DSA model config (MTP layers after the base layers)."""

from __future__ import annotations

import torch
from kvcore.layout import KVLayout

from dsamodel.config import ModelConfig


def kv_layout(config: ModelConfig, block_size: int, dtype: torch.dtype | None = None) -> KVLayout:
    """Main latent cache (kv_lora_rank + rope) and indexer keys per layer, in ``dtype``."""
    return KVLayout.for_mla(
        num_hidden_layers=config.num_hidden_layers,
        kv_lora_rank=config.kv_lora_rank,
        qk_rope_head_dim=config.qk_rope_head_dim,
        block_size=block_size,
        dtype=dtype or config.dtype,
        num_mtp_layers=config.num_nextn_predict_layers,
        index_head_dim=config.index_head_dim,
    )
