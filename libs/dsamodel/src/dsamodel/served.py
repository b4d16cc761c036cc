"""``ServedModel``: the models an engine serves (the DSA model, a Llama model with an indexer), and
``sparse_ready``, the start-up check that a model can select tokens for sparse attention."""

from __future__ import annotations

from pathlib import Path

from dsamodel.llama import LlamaModel
from dsamodel.model import DSAModel

ServedModel = DSAModel | LlamaModel

# how a Llama model directory gets its indexer (docs/models.md)
BUILD_INDEXER = "kvoffload model fetch smollm2 (SmolLM2), or kvoffload model indexer DIR (any Llama directory)"


def sparse_ready(model: ServedModel, model_dir: str | Path) -> str:
    """Why ``model`` (loaded from ``model_dir``) cannot serve sparse decode; "" when it can. A Llama
    model needs the indexer built beside its weights; the DSA model carries its own."""
    if isinstance(model, LlamaModel) and not model.has_indexer:
        return (
            f"{model_dir} is a Llama model without an indexer (kvoffload-indexer.json and "
            f".safetensors beside its weights): sparse decode selects each step's top-k tokens with one; "
            f"build it with {BUILD_INDEXER}"
        )
    return ""
