"""The kvcore ``KVLayout`` of a model config: a DSA model's (MLA latent rows, MTP layers after the
base layers) or a Llama model's (K and V rows of every KV head, the PCA indexer's keys)."""

from __future__ import annotations

import torch

from dsamodel.config import ModelConfig
from dsamodel.indexcodec import indexer_cache_format
from dsamodel.llama_config import LlamaConfig
from kvcore.layout import KVLayout


def kv_layout(config: ModelConfig | LlamaConfig, block_size: int, dtype: torch.dtype | None = None) -> KVLayout:
    """Main cache rows in ``dtype`` and indexer keys per layer: in ``dtype``, or fp8 plus scales where a
    DSA config's indexer cache is fp8 (``dsamodel.indexcodec``). A Llama config without an indexer
    gets none (such a model is refused where sparse decode needs it)."""
    if isinstance(config, LlamaConfig):
        return KVLayout.for_gqa(
            num_hidden_layers=config.num_hidden_layers,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            block_size=block_size,
            dtype=dtype or config.dtype,
            index_head_dim=config.index_head_dim,
        )
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
