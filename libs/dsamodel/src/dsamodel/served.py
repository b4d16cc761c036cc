"""``ServedModel``: the models an engine serves (the DSA model, a Llama model with an indexer), their
layers (``ServedLayer``), their configs (``read_config``: a directory's, its indexer included, without
loading weights), and ``sparse_ready``, the start-up check that a model can select tokens for sparse
attention."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dsamodel.config import ModelConfig, read_config_json
from dsamodel.llama import NO_INDEXER, LlamaLayer, LlamaModel, LlamaProjection
from dsamodel.llama_config import MODEL_TYPE as LLAMA
from dsamodel.llama_config import LlamaConfig
from dsamodel.llama_weights import llama_config
from dsamodel.model import DecoderLayer, DSAModel, Projection
from dsamodel.pca_indexer import read_indexer_meta

ServedModel = DSAModel | LlamaModel
ServedLayer = DecoderLayer | LlamaLayer
ServedConfig = ModelConfig | LlamaConfig

# how a Llama model directory gets its indexer (docs/models.md)
BUILD_INDEXER = "kvoffload model fetch smollm2 (SmolLM2), or kvoffload model indexer DIR (any Llama directory)"


def sparse_ready(model: ServedModel, model_dir: str | Path) -> str:
    """Why ``model`` (loaded from ``model_dir``) cannot serve sparse decode; "" when it can. A Llama
    model needs the indexer built beside its weights; the DSA model carries its own."""
    if isinstance(model, LlamaModel) and not model.has_indexer:
        return (
            f"{model_dir} is a Llama model without an indexer (no kvoffload-indexer/ folder "
            f"beside its weights): sparse decode selects each step's top-k tokens with one; "
            f"build it with {BUILD_INDEXER}"
        )
    return ""


def index_topk(model: ServedModel, model_dir: str | Path = "the model") -> int:
    """The tokens the model's indexer selects per query; ValueError (``sparse_ready``'s reason) for a
    model that has no indexer."""
    topk = model.config.index_topk
    if topk is None:
        raise ValueError(sparse_ready(model, model_dir) or f"{model_dir} has no index_topk")
    return topk


def index_keys(proj: Projection | LlamaProjection) -> torch.Tensor:
    """A projection's indexer cache rows [T, Di]; ValueError for a Llama model without an indexer."""
    if proj.index_k is None:
        raise ValueError(NO_INDEXER)
    return proj.index_k


def read_config(model_dir: str | Path) -> ServedConfig:
    """The config of the model in model_dir (a Llama model's with its indexer's rank and top-k when it
    has one), from its files alone: no weights read. ValueError naming what is wrong."""
    if read_config_json(model_dir).get("model_type") != LLAMA:
        return ModelConfig.from_json(Path(model_dir) / "config.json")
    config, meta = llama_config(model_dir), read_indexer_meta(model_dir)
    if meta is None:
        return config
    return dataclasses.replace(config, index_rank=meta["rank"], index_topk=meta["index_topk"])
