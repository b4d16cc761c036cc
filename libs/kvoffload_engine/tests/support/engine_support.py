"""Builders shared by the engine tests: tiny models with/without MTP, small pools, saved bytes, a
hand-made top-k trace."""

from __future__ import annotations

import dataclasses

import torch

from dsamodel.model import DSAModel
from dsamodel.presets import init_weights, tiny_config
from kvcore.traces import Trace
from kvoffload_engine import build

_MODELS: dict = {}


def tiny(dtype: torch.dtype = torch.float32, mtp: bool = True, fp8_indexer: bool = False) -> DSAModel:
    key = (dtype, mtp, fp8_indexer)
    if key not in _MODELS:
        cfg = dataclasses.replace(
            tiny_config(dtype="float32", fp8_indexer=fp8_indexer), num_nextn_predict_layers=1 if mtp else 0
        )
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


def hand_trace(*, requests=2, groups=1, layers=4, context0=201, steps=4, k=64, new=16, seed=0) -> Trace:
    """A hand-made top-k trace (``k`` 64: the tiny preset's index_topk). Per stream: k random positions
    at step 0, then each step ``new`` of them swapped for positions never selected before (so step t
    shares exactly k - new with step t - 1, and every new one misses)."""
    gen = torch.Generator().manual_seed(seed)
    keys = [(r, g, layer) for r in range(requests) for g in range(groups) for layer in range(layers)]
    out = torch.empty(len(keys), steps, k, dtype=torch.int32)
    for s in range(len(keys)):
        cur = torch.randperm(context0, generator=gen)[:k]
        fresh = torch.ones(context0 + steps, dtype=torch.bool)  # never selected yet
        for t in range(steps):
            if t:
                keep = cur[torch.randperm(k, generator=gen)[: k - new]]
                free = fresh[: context0 + t].nonzero().flatten()
                cur = torch.cat((keep, free[torch.randperm(free.numel(), generator=gen)[:new]]))
            fresh[cur] = False
            out[s, t] = cur.sort().values.to(torch.int32)
    col = lambda i: torch.tensor([key[i] for key in keys], dtype=torch.int32)  # noqa: E731
    return Trace("hand", out, torch.full((len(keys),), context0, dtype=torch.int64), col(2), col(0), col(1))
