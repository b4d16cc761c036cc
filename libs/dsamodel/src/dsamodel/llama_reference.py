"""Whole-sequence reference paths of a ``LlamaModel`` (no caches, no offload), to check engines against.

- ``forward_llama_dense``: every layer runs the engine's dense steps over the whole sequence as one
  chunk (``project``, ``attend_causal`` over the sequence's own rows, ``finish``). An engine that
  runs the same tokens as one prefill chunk gets bit-identical logits.
- ``forward_llama_sparse``: the sparse steps instead (``select`` of ``topk`` tokens over the
  sequence's own indexer rows as the cache stores them, gather in top-k order, ``attend``): the
  indexer's attention, what sparse decode computes for every position at once.
- ``generate_llama_dense``: sampling by recomputing ``forward_llama_dense`` each step (slow,
  obviously correct).
"""

from __future__ import annotations

import torch

from dsamodel.attention import gather_rows
from dsamodel.llama import NO_INDEXER, LlamaLayer, LlamaModel
from dsamodel.sampling import RequestSampler
from openai_api.sampling_params import SamplingParams


def dense_llama_layer(layer: LlamaLayer, h: torch.Tensor) -> torch.Tensor:
    """One layer over a whole sequence h [T, D] (positions 0..T-1), dense causal attention -> [T, D]."""
    positions = torch.arange(h.shape[0], device=h.device)  # [T]
    proj = layer.project(h, positions)
    return layer.finish(h, layer.attend_causal(proj, proj.kv, positions))


def sparse_llama_layer(model: LlamaModel, layer: LlamaLayer, h: torch.Tensor, topk: int) -> torch.Tensor:
    """One layer over h [T, D]: each position attends over the indexer's top-k of its past -> [T, D]."""
    positions = torch.arange(h.shape[0], device=h.device)  # [T]
    proj = layer.project(h, positions)
    assert proj.index_k is not None  # select() below refuses a model without an indexer first
    codec = model.index_codec  # the keys as a cache holds them
    indices = layer.select(proj, codec.decode(codec.encode(proj.index_k)), positions, topk)  # [T, k]
    rows, valid = gather_rows(proj.kv, indices)  # [T, k, W], [T, k]
    return layer.finish(h, layer.attend(proj, rows, valid))


def forward_llama_hidden(model: LlamaModel, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [T] -> h [T, D] after the last layer (dense)."""
    h = model.embed(tokens)
    for layer in model.layers:
        h = dense_llama_layer(layer, h)
    return h


def forward_llama_dense(model: LlamaModel, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [T] -> float32 logits [T, V], dense causal attention in every layer."""
    return model.logits(forward_llama_hidden(model, tokens))


def forward_llama_sparse(model: LlamaModel, tokens: torch.Tensor, topk: int | None = None) -> torch.Tensor:
    """tokens [T] -> float32 logits [T, V], every layer attending over its indexer's top-k
    (``topk`` default: the model's ``index_topk``)."""
    k = model.config.index_topk if topk is None else topk
    if k is None:
        raise ValueError(f"forward_llama_sparse: {NO_INDEXER}")
    h = model.embed(tokens)
    for layer in model.layers:
        h = sparse_llama_layer(model, layer, h, k)
    return model.logits(h)


def generate_llama_dense(model: LlamaModel, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """Sample up to ``params.max_tokens`` tokens after ``prompt_ids``, recomputing the dense forward."""
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    sampler = RequestSampler(params, eos_token_id=model.config.eos_token_id)
    ids = list(prompt_ids)
    while not sampler.finished:
        logits = forward_llama_dense(model, torch.tensor(ids, dtype=torch.long, device=model.device))  # [T, V]
        ids.append(sampler.step(logits[-1]))
    return list(sampler.output_ids)
