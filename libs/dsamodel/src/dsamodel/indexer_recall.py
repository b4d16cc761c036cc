"""How much of a Llama model's true attention its PCA indexer's top-k keeps (``attention_recall``).

For queries late in a long sequence, per layer: the dense attention mass of each visible position
(softmax over all visible positions in float32, summed over the layer's query heads, divided by the
number of heads, so each query's masses sum to 1), and the share of it that falls in

- ``indexer``: the indexer's selection (``pca_select`` over the keys as the cache stores them, at
  rank r: a prefix of the PCA basis is the rank-r PCA, so one built basis measures every r <= its
  rank);
- ``oracle``: the exact top-k by true mass (the ceiling);
- ``recency``: the first ``SINKS`` tokens plus the last k - ``SINKS`` (the floor: a sliding window
  with attention sinks, the same budget of k tokens).

The forward itself is the dense one (``attend_causal``), so every layer's input is the model's.
Reported: per (k, r), the median over layers and queries (and the 10th percentile, and the worst
layer's median, beside the oracle's worst layer: in a layer whose attention is spread thin even the
exact top-k keeps little).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from dsamodel.llama import NO_INDEXER, LlamaLayer, LlamaModel, LlamaProjection

SINKS = 4  # first tokens the recency baseline always keeps
DEFAULT_QUERIES = 64  # the last positions of the sequence are the queries


def attention_recall(
    model: LlamaModel,
    tokens: torch.Tensor,
    k: int | Sequence[int],
    *,
    layers: Iterable[int] | None = None,
    query_positions: torch.Tensor | None = None,
    ranks: Sequence[int] | None = None,
) -> dict[str, Any]:
    """tokens [T] (one long text) -> {"context", "queries", "layers", "results": [per (k, rank):
    {"k", "rank", "indexer", "indexer_p10", "indexer_worst_layer", "oracle", "oracle_worst_layer",
    "recency"}]} (module doc).
    ``query_positions`` default: the last 64; ``ranks`` default: the indexer's own rank."""
    full = model.config.index_rank
    if full is None:
        raise ValueError(f"attention_recall: {NO_INDEXER}")
    ks, rs = ([k] if isinstance(k, int) else list(k)), ([full] if ranks is None else list(ranks))
    if not ks or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ks):
        raise ValueError(f"k must be ints >= 1, got {k!r}")
    if not rs or any(isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= full for r in rs):
        raise ValueError(f"ranks must be ints in [1, {full}] (the built basis's rank), got {ranks!r}")
    t = tokens.shape[0]
    qpos = torch.arange(max(0, t - DEFAULT_QUERIES), t) if query_positions is None else query_positions
    qpos = qpos.to(device=model.device, dtype=torch.long)
    if qpos.dim() != 1 or not qpos.numel() or int(qpos.min()) < 0 or int(qpos.max()) >= t:
        raise ValueError(f"query_positions must be a non-empty [Q] tensor in [0, {t}), got {qpos.tolist()[:8]}")
    chosen = sorted(set(range(model.config.num_hidden_layers) if layers is None else layers))
    samples: dict[tuple[str, int, int], list[torch.Tensor]] = {}
    positions = torch.arange(t, device=model.device)  # [T]
    h = model.embed(tokens.to(model.device))  # [T, D]
    for i, layer in enumerate(model.layers[: chosen[-1] + 1]):
        proj = layer.project(h, positions)
        if i in chosen:
            _measure(model, layer, proj, qpos, ks, rs, samples)
        if i < chosen[-1]:
            h = layer.finish(h, layer.attend_causal(proj, proj.kv, positions))
    rows = [_summary(samples, kk, r) for kk in ks for r in rs]
    return {"context": t, "queries": int(qpos.numel()), "layers": chosen, "sinks": SINKS, "results": rows}


def attention_mass(layer: LlamaLayer, proj: LlamaProjection, qpos: torch.Tensor) -> torch.Tensor:
    """Dense attention mass of the queries at qpos [Q] over every position: [Q, T] float32, each
    row summing to 1 (softmax per head, summed over heads, divided by the number of heads)."""
    attn = layer.self_attn
    t, kv, hd = proj.kv.shape[0], attn.num_kv_heads, attn.head_dim
    q = proj.q[qpos].to(torch.float32)  # [Q, H, hd]
    n, heads = q.shape[0], q.shape[1]
    keys = proj.kv[:, : kv * hd].to(torch.float32).reshape(t, kv, hd).permute(1, 2, 0)  # [KV, hd, T]
    qg = q.reshape(n, kv, heads // kv, hd).transpose(0, 1).reshape(kv, -1, hd)  # [KV, Q*G, hd]
    scores = (torch.matmul(qg, keys) * layer.softmax_scale).view(kv, n, heads // kv, t)  # [KV, Q, G, T]
    visible = torch.arange(t, device=qpos.device)[None, :] <= qpos[:, None]  # [Q, T]
    scores.masked_fill_(~visible[None, :, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1).sum(dim=(0, 2)) / heads  # [Q, T]


def _measure(model, layer, proj, qpos, ks, ranks, samples) -> None:
    """Append this layer's per-query recalls [Q] for every (k, rank) to ``samples``."""
    mass = attention_mass(layer, proj, qpos)  # [Q, T]
    t = mass.shape[1]
    cols = torch.arange(t, device=mass.device)[None, :]  # [1, T]
    codec, full = model.index_codec, model.config.index_rank
    keys = codec.decode(codec.encode(proj.index_k))  # [T, KV * R], as a cache holds them
    keys = keys.reshape(t, -1, full)  # [T, KV, R]
    for kk in ks:
        oracle = mass.topk(min(kk, t), dim=-1).values.sum(-1)  # [Q]
        window = (cols < SINKS) | (cols > qpos[:, None] - max(kk - SINKS, 0))  # [Q, T]
        recency = torch.where(window, mass, 0.0).sum(-1)  # [Q] (invisible positions hold no mass)
        for r in ranks:
            sub = dataclasses.replace(proj, index_q=proj.index_q[qpos][..., :r])
            sel = layer.select(sub, keys[..., :r].reshape(t, -1), qpos, kk)  # [Q, k]
            got = torch.where(sel >= 0, mass.gather(1, sel.clamp(min=0)), 0.0).sum(-1)  # [Q]
            samples.setdefault(("indexer", kk, r), []).append(got)
            samples.setdefault(("oracle", kk, r), []).append(oracle)
            samples.setdefault(("recency", kk, r), []).append(recency)


def _summary(samples, k: int, rank: int) -> dict[str, Any]:
    def stack(name: str) -> torch.Tensor:
        return torch.stack(samples[(name, k, rank)])  # [layers, Q]

    indexer = stack("indexer")
    return {
        "k": k,
        "rank": rank,
        "indexer": _round(indexer.flatten().quantile(0.5)),
        "indexer_p10": _round(indexer.flatten().quantile(0.1)),
        "indexer_worst_layer": _round(indexer.quantile(0.5, dim=1).min()),
        "oracle": _round(stack("oracle").flatten().quantile(0.5)),
        "oracle_worst_layer": _round(stack("oracle").quantile(0.5, dim=1).min()),
        "recency": _round(stack("recency").flatten().quantile(0.5)),
    }


def _round(x: torch.Tensor) -> float:
    return round(float(x), 4)
