"""Reading a safetensors checkpoint (one file, a directory's ``model.safetensors`` or its shards) and
checking its tensors against the names and shapes a model expects, for every model's loader
(``dsamodel.weights``, ``dsamodel.llama_weights``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_LISTED = 20  # names shown per category in error messages


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, of a directory's ``model.safetensors``, or of its shards."""
    path = Path(path)
    if path.is_dir():
        if (path / WEIGHTS_NAME).is_file():
            path = path / WEIGHTS_NAME
        elif (path / INDEX_NAME).is_file():
            weight_map = json.loads((path / INDEX_NAME).read_text()).get("weight_map", {})
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                tensors.update(load_file(str(path / shard)))
            return tensors
        else:
            raise ValueError(f"no {WEIGHTS_NAME} or {INDEX_NAME} in {path}")
    if not path.is_file():
        raise ValueError(f"no weights file at {path}")
    return load_file(str(path))


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    """ValueError listing every missing, unexpected, mis-shaped and non-floating tensor."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = sorted(
        f"{name}: {list(t.shape)} (expected {list(expected[name])})"
        for name, t in tensors.items()
        if name in expected and tuple(t.shape) != expected[name]
    )
    non_float = sorted(f"{name}: {t.dtype}" for name, t in tensors.items() if not t.is_floating_point())
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:_LISTED])}{' ...' if len(items) > _LISTED else ''}"
        for label, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mis-shaped", misshaped),
            ("non-floating", non_float),
        )
        if items
    ]
    if problems:
        raise ValueError("checkpoint does not match the model config: " + "; ".join(problems))
