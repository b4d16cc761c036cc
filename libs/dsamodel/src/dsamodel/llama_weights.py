"""Load a Llama model directory: HF-named safetensors weights, plus the PCA indexer when present.

Checkpoint names are the model's own ``state_dict()`` keys (``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``.input_layernorm.weight``,
``.post_attention_layernorm.weight``, ``.mlp.{gate,up,down}_proj.weight``, ``model.norm.weight``,
``lm_head.weight`` unless tied). Checks and errors are ``dsamodel.weights``'s (every missing,
unexpected, mis-shaped or non-floating tensor listed). When ``kvoffload-indexer/``'s json and
safetensors lie beside the weights (``dsamodel.pca_indexer``), the config
gains the indexer's rank and default ``index_topk`` and every layer its bases; without them the
model has no indexer (``has_indexer`` False).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsamodel.checkpoint import check_tensors, read_checkpoint
from dsamodel.config import read_config_json
from dsamodel.llama import LlamaModel
from dsamodel.llama_config import LlamaConfig
from dsamodel.pca_indexer import load_bases, read_indexer_meta


def llama_config(model_dir: str | Path, *, dtype: str | None = None) -> LlamaConfig:
    """model_dir's LlamaConfig (``torch_dtype`` = ``dtype`` when given), without its indexer."""
    data = read_config_json(model_dir)
    if dtype is not None:
        data = {**data, "torch_dtype": dtype}
        data.pop("dtype", None)
    return LlamaConfig.from_dict(data)


def load_llama_weights(model: LlamaModel, path: str | Path) -> LlamaModel:
    """Copy a checkpoint into ``model`` (cast to its dtype) after checking every name and shape."""
    tensors = read_checkpoint(path)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        lm_head = tensors.pop("lm_head.weight", None)
        embed = tensors.get("model.embed_tokens.weight")
        if lm_head is not None and (embed is None or not torch.equal(lm_head, embed)):
            raise ValueError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
    check_tensors(tensors, expected)
    model.load_state_dict({name: t.to(model.dtype) for name, t in tensors.items()}, strict=False)
    return model


def load_llama_model(model_dir: str | Path, *, dtype: str | torch.dtype | None = None, device=None) -> LlamaModel:
    """``config.json`` + weights (+ the PCA indexer, when built) in model_dir -> a LlamaModel."""
    names = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
    if isinstance(dtype, torch.dtype) and dtype not in names:
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
    name = names[dtype] if isinstance(dtype, torch.dtype) else dtype
    config = llama_config(model_dir, dtype=name)
    model = load_llama_weights(LlamaModel(config, device=device), model_dir)
    meta = read_indexer_meta(model_dir)
    if meta is not None:
        shape = (config.num_key_value_heads, config.head_dim, meta["rank"])
        model.attach_indexer(load_bases(model_dir, config.num_hidden_layers, shape), meta["index_topk"])
    return model
