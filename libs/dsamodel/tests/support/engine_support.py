"""Builders shared by the engine tests: tiny models with/without MTP, small pools, saved bytes."""

from __future__ import annotations

import dataclasses

import torch

from dsamodel.engine import build
from dsamodel.model import DSAModel
from dsamodel.presets import init_weights, tiny_config

_MODELS: dict = {}


def tiny(dtype: torch.dtype = torch.float32, mtp: bool = True, fp8_indexer: bool = False) -> DSAModel:
    key = (dtype, mtp, fp8_indexer)
    if key not in _MODELS:
        cfg = dataclasses.replace(tiny_config(dtype="float32", fp8_indexer=fp8_indexer),
                                  num_nextn_predict_layers=1 if mtp else 0)
        _MODELS[key] = init_weights(DSAModel(cfg, dtype=torch.float32), seed=0).to(dtype)
    return _MODELS[key]


def prefill_pool(model, block_size, capacity_bytes=32 << 20):
    return build.prefill_pool(model, block_size, capacity_bytes)


def decode_pool(model, block_size, capacity_bytes=32 << 20):
    return build.decode_pool(model, block_size, capacity_bytes)


def prefill_engine(model, pool, *, max_model_len=1024, **kw):
    return build.prefill_engine(model, pool, max_model_len=max_model_len, model_id="tiny-test", **kw)


def saved_bytes(pool, keys: list[bytes]) -> list[torch.Tensor]:
    """Every plane's bytes of ``keys``' blocks, in key order."""
    ids = torch.tensor(pool.block_ids(keys), dtype=torch.long)
    return [pool.plane(p)[ids].clone() for p in range(pool.geometry.num_planes)]


def seeded_prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))
