"""The tiny seeded model: a few MB, 4 decoder layers + 1 MTP layer, real top-k sparsity.

``num_hidden_layers`` (default 4) deepens it with more decoder layers of the same shape, e.g. 27
(+ 1 MTP = 28 cache layers) for benchmarks where many layers share a few device buffers; the
default config, and so the default seeded weights, are unchanged by the parameter.

``index_topk`` is 64, so prompts of 1-8K tokens select a small, query-dependent subset. Weights are
drawn from one seeded CPU generator in ``named_parameters`` order, so the same seed writes
byte-identical files. Scales keep activations near unit size through the layers: inputs to every
projection are normalized, projections use std ``1/sqrt(fan_in)``, residual writers (``o_proj``,
``down_proj``, ``eh_proj``) are further scaled by ``1/sqrt(2 * num_cache_layers)``, embeddings
have std 1, norms start at 1 and the indexer LayerNorm bias at 0.
Random weights on random byte prompts give the indexer little step-to-step locality (a few percent
adjacent-step top-k overlap at 8K context, where trained DSA models report 60-95%): hit rates
measured on this model are a floor, not a forecast.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsamodel.config import ModelConfig
from dsamodel.model import DSAModel
from dsamodel.tokenizer import ByteTokenizer
from dsamodel.weights import save_model

_RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight")


def tiny_config(*, dtype: str = "bfloat16", num_hidden_layers: int = 4, fp8_indexer: bool = False) -> ModelConfig:
    """The tiny preset's config (byte tokenizer vocabulary: 256 bytes + 8 specials); ``num_hidden_layers``
    decoder layers (default 4) plus one MTP layer. ``fp8_indexer``: architecture
    ``DeepseekV32ForCausalLM``, so its indexer cache holds fp8 keys plus float32 scales, as
    DeepSeek-V3.2's does (``dsamodel.indexcodec``); the weights are the same."""
    tok = ByteTokenizer()
    return ModelConfig(
        hidden_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        q_lora_rank=96,
        kv_lora_rank=192,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=64,
        num_nextn_predict_layers=1,
        vocab_size=tok.vocab_size,
        max_position_embeddings=32768,
        intermediate_size=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        torch_dtype=dtype,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        architectures=("DeepseekV32ForCausalLM",) if fp8_indexer else (),
    )


@torch.no_grad()
def init_weights(model: DSAModel, *, seed: int) -> DSAModel:
    """Fill every parameter deterministically from ``seed`` (see module doc for the scales)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    residual_scale = (2 * model.config.num_cache_layers) ** -0.5
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("norm.bias"):
            param.zero_()
        else:
            std = 1.0 if name == "model.embed_tokens.weight" else param.shape[-1] ** -0.5
            if name.endswith(_RESIDUAL_WRITERS) or name.endswith("eh_proj.weight"):
                std *= residual_scale
            values = torch.randn(param.shape, generator=gen, dtype=torch.float32) * std
            param.copy_(values.to(param.device))
    return model


def tiny_model(
    *, seed: int = 0, dtype: str = "float32", device=None, num_hidden_layers: int = 4, fp8_indexer: bool = False
) -> DSAModel:
    """The tiny preset built in memory (what ``write_tiny`` saves, before the dtype cast); see
    ``tiny_config`` for ``num_hidden_layers`` and ``fp8_indexer``."""
    config = tiny_config(dtype=dtype, num_hidden_layers=num_hidden_layers, fp8_indexer=fp8_indexer)
    return init_weights(DSAModel(config, device=device), seed=seed)


def write_tiny(out_dir: str | Path, *, seed: int = 0, dtype: str = "bfloat16", fp8_indexer: bool = False) -> Path:
    """Write config.json, model.safetensors and tokenizer_config.json of the tiny preset."""
    out_dir = Path(out_dir)
    model = tiny_model(seed=seed, dtype="float32", fp8_indexer=fp8_indexer)
    if dtype != "float32":
        model = model.to(tiny_config(dtype=dtype).dtype)  # validates dtype; fp32 draws, then one cast
    save_model(model, out_dir)
    ByteTokenizer().save(out_dir)
    return out_dir
