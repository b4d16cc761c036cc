"""Load and save weights as safetensors with HF DeepSeek-V3.2 parameter names.

The module tree of ``DSAModel`` mirrors the checkpoint, so the expected names and shapes are the
model's own ``state_dict()``: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.*``
(``q_a_proj``/``q_a_layernorm``/``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, ``indexer.{wq_b,wk,k_norm,weights_proj}``),
``.input_layernorm``, ``.post_attention_layernorm``, ``.mlp.{gate,up,down}_proj``, MTP layers
``model.layers.{N+j}.{enorm,hnorm,eh_proj,shared_head.norm}`` plus a decoder layer, ``model.norm``
and ``lm_head`` (absent when ``tie_word_embeddings``; if present it must equal the embeddings).
A sharded checkpoint (``model.safetensors.index.json``) loads too. Tensors are cast to the model's
dtype; anything missing, unexpected, mis-shaped or non-floating is a ValueError listing them all.
``load_model`` of a directory whose ``config.json`` has ``model_type`` ``llama`` returns a
``LlamaModel`` (``dsamodel.llama_weights``); both read and check through ``dsamodel.checkpoint``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from dsamodel.checkpoint import WEIGHTS_NAME, check_tensors, read_checkpoint
from dsamodel.config import ModelConfig, read_config_json
from dsamodel.llama import LlamaModel
from dsamodel.llama_config import MODEL_TYPE as LLAMA_MODEL_TYPE
from dsamodel.model import DSAModel


def checkpoint_shapes(model: DSAModel) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor a checkpoint of this model holds."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def save_weights(model: DSAModel, path: str | Path) -> Path:
    """Write the model's tensors (checkpoint names, model dtype) to one safetensors file."""
    path = Path(path)
    names = checkpoint_shapes(model)
    state = model.state_dict()
    tensors = {name: state[name].detach().to("cpu").contiguous() for name in sorted(names)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def load_weights(model: DSAModel, path: str | Path) -> DSAModel:
    """Copy a checkpoint into ``model`` (cast to its dtype) after checking every name and shape."""
    tensors = read_checkpoint(path)
    expected = checkpoint_shapes(model)
    if model.config.tie_word_embeddings and "lm_head.weight" in tensors:
        lm_head = tensors.pop("lm_head.weight")
        embed = tensors.get("model.embed_tokens.weight")
        if embed is None or not torch.equal(lm_head, embed):
            raise ValueError("tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight")
    check_tensors(tensors, expected)
    state = {name: t.to(model.dtype) for name, t in tensors.items()}
    model.load_state_dict(state, strict=not model.config.tie_word_embeddings)
    return model


def load_model(model_dir: str | Path, *, dtype: str | torch.dtype | None = None, device=None) -> DSAModel | LlamaModel:
    """``config.json`` + weights in ``model_dir`` -> a DSAModel in ``dtype`` (default: the config's),
    or a LlamaModel (``dsamodel.llama_weights``) when the config's ``model_type`` is ``llama``."""
    if _model_type(model_dir) == LLAMA_MODEL_TYPE:
        from dsamodel.llama_weights import load_llama_model

        return load_llama_model(model_dir, dtype=dtype, device=device)
    config = ModelConfig.from_json(Path(model_dir) / "config.json")
    if isinstance(dtype, str):
        dtype = ModelConfig(**{**config.to_dict(), "torch_dtype": dtype}).dtype
    model = DSAModel(config, dtype=dtype, device=device)
    return load_weights(model, model_dir)


def _model_type(model_dir: str | Path) -> object:
    """``model_type`` of model_dir's ``config.json`` (None when unreadable: ModelConfig says why)."""
    try:
        return read_config_json(model_dir).get("model_type")
    except (OSError, ValueError):
        return None


def save_model(model: DSAModel, out_dir: str | Path) -> Path:
    """Write ``config.json`` (torch_dtype = the model's dtype) and ``model.safetensors`` into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype_name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[model.dtype]
    ModelConfig(**{**model.config.to_dict(), "torch_dtype": dtype_name}).to_json(out_dir / "config.json")
    save_weights(model, out_dir / WEIGHTS_NAME)
    return out_dir
