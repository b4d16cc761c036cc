"""Whole-sequence reference paths (no caches, no offload), used to check engines and the math.

- ``forward_dense``: every layer runs the engine's steps over the full prompt at once (project,
  ``indexer_topk`` over all of the prompt's indexer rows, ``gather_rows``, ``sparse_mla_attention``,
  finish). An engine that runs the same prompt as one chunk gets bit-identical logits.
- ``forward_naive``: the same model written the textbook way: per-head K and V expanded from the
  latent through ``kv_b_proj``, full causal score matrix, a boolean mask of the selected tokens.
  No absorption, no gather: agreement with ``forward_dense`` proves the absorbed sparse math.
- ``forward_dense_mtp``: the MTP layers over a whole sequence; ``generate_dense``: sampling by
  recomputing ``forward_dense`` each step (slow, obviously correct).

A ``selector(cache_index, projection, positions) -> [T, k]`` may replace the indexer's choice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsamodel.attention import gather_rows, indexer_topk, sparse_mla_attention
from dsamodel.model import DecoderLayer, DSAModel, Projection
from dsamodel.sampling import RequestSampler
from openai_api.sampling_params import SamplingParams

Selector = Callable[[int, Projection, torch.Tensor], torch.Tensor]


def select_topk(
    layer: DecoderLayer, proj: Projection, positions: torch.Tensor, topk: int, selector: Selector | None
) -> torch.Tensor:
    """The indexer's causal top-k over this sequence's own rows, or ``selector``'s choice: [T, k]."""
    if selector is not None:
        return selector(layer.cache_index, proj, positions)
    codec = layer.self_attn.indexer.codec  # the keys as a cache holds them (fp8: quantized)
    return indexer_topk(proj.index_q, proj.index_w, codec.decode(codec.encode(proj.index_k)), positions, topk)


def dense_layer(layer: DecoderLayer, h: torch.Tensor, topk: int, selector: Selector | None = None) -> torch.Tensor:
    """One layer over a whole sequence h [T, D] (positions 0..T-1) -> [T, D]."""
    positions = torch.arange(h.shape[0], device=h.device)  # [T]
    proj = layer.project(h, positions)
    indices = select_topk(layer, proj, positions, topk, selector)  # [T, k]
    rows, valid = gather_rows(proj.kv, indices)  # [T, k, R + r], [T, k]
    latent = sparse_mla_attention(proj.q_latent, proj.q_rope, rows, valid, layer.softmax_scale)  # [T, H, R]
    return layer.finish(h, latent)


def forward_hidden(model: DSAModel, tokens: torch.Tensor, *, selector: Selector | None = None) -> torch.Tensor:
    """tokens [T] -> h [T, D] after the last base layer (dense sparse path)."""
    h = model.embed(tokens)
    for layer in model.layers:
        h = dense_layer(layer, h, model.config.index_topk, selector)
    return h


def forward_dense(model: DSAModel, tokens: torch.Tensor, *, selector: Selector | None = None) -> torch.Tensor:
    """tokens [T] -> float32 logits [T, V] through the absorbed sparse path."""
    return model.logits(forward_hidden(model, tokens, selector=selector))


def forward_dense_mtp(model: DSAModel, tokens: torch.Tensor) -> list[torch.Tensor]:
    """tokens [T] -> per MTP depth j, float32 logits [T-1-j, V]; row i predicts token i+j+2."""
    h_prev = model.final_norm(forward_hidden(model, tokens))  # [T, D]
    out = []
    for depth, layer in enumerate(model.mtp):
        n = tokens.shape[0] - 1 - depth
        if n <= 0:
            break
        h = model.mtp_input(h_prev[:n], tokens[depth + 1 : depth + 1 + n], depth)  # [n, D]
        h = dense_layer(layer, h, model.config.index_topk)
        out.append(model.mtp_logits(h, depth))  # [n, V]
        h_prev = layer.shared_head.norm(h)
    return out


def forward_naive(model: DSAModel, tokens: torch.Tensor, *, selector: Selector | None = None) -> torch.Tensor:
    """tokens [T] -> float32 logits [T, V] with per-head K/V and a boolean selection mask."""
    h = model.embed(tokens)
    for layer in model.layers:
        h = _naive_layer(layer, h, model.config.index_topk, selector)
    return model.logits(h)


def _naive_layer(layer: DecoderLayer, h: torch.Tensor, topk: int, selector: Selector | None) -> torch.Tensor:
    attn = layer.self_attn
    t, heads, n, big_r = h.shape[0], attn.num_heads, attn.nope_dim, attn.kv_lora_rank
    positions = torch.arange(t, device=h.device)  # [T]
    x = layer.input_layernorm(h)  # [T, D]
    q_nope, q_rope, qr = attn.queries(x, positions)  # [T, H, n], [T, H, r]
    kv = attn.latent_kv(x, positions)  # [T, R + r]
    k_pe = kv[:, big_r:]  # [T, r]
    kv_up = attn.kv_b_proj(kv[:, :big_r]).view(t, heads, n + attn.v_dim)  # [T, H, n + v]
    k = torch.cat((kv_up[..., :n], k_pe[:, None, :].expand(t, heads, k_pe.shape[-1])), dim=-1)  # [T, H, n + r]
    q = torch.cat((q_nope, q_rope), dim=-1)  # [T, H, n + r]
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * layer.softmax_scale  # [H, T, T]
    if selector is None:
        index_q, index_w, index_k = attn.indexer.project(x, qr, positions)
        codec = attn.indexer.codec  # the keys as a cache holds them (fp8: quantized)
        indices = indexer_topk(index_q, index_w, codec.decode(codec.encode(index_k)), positions, topk)  # [T, k]
    else:
        indices = selector(layer.cache_index, layer.project(h, positions), positions)
    mask = torch.zeros((t, t + 1), dtype=torch.bool, device=h.device)  # [T, T + 1]; column T absorbs -1
    mask.scatter_(1, torch.where(indices >= 0, indices, t), True)
    probs = torch.softmax(scores.masked_fill(~mask[None, :, :t], float("-inf")), dim=-1)  # [H, T, T]
    out = torch.einsum("hts,shv->thv", probs, kv_up[..., n:].float()).to(h.dtype)  # [T, H, v]
    h = h + attn.o_proj(out.reshape(t, heads * attn.v_dim))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def generate_dense(model: DSAModel, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """Sample up to ``params.max_tokens`` tokens after ``prompt_ids``, recomputing ``forward_dense``."""
    if not prompt_ids:
        raise ValueError("prompt_ids must hold at least one token")
    sampler = RequestSampler(params, eos_token_id=model.config.eos_token_id)
    ids = list(prompt_ids)
    while not sampler.finished:
        logits = forward_dense(model, torch.tensor(ids, dtype=torch.long, device=model.device))  # [T, V]
        ids.append(sampler.step(logits[-1]))
    return list(sampler.output_ids)
