"""Pure attention functions an engine calls between ``project`` and ``finish``.

- ``indexer_topk``: the lightning indexer's causal top-k over a request's indexer cache.
- ``gather_rows``: the plain (keep-everything-on-device) gather of cache rows in top-k order.
- ``sparse_mla_attention``: absorbed MLA over gathered latent rows.

Each is a function of its arguments only. ``sparse_mla_attention`` in particular sees only
(queries, rows in top-k order, validity): two engines that gather the same rows in the same order,
from wherever they keep them, get bit-identical outputs for the same tensor shapes. Rows marked
invalid may hold anything (stale slots, NaN); they contribute exactly nothing.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_BYTES = 128 << 20  # indexer working-set budget per query chunk


def indexer_topk(
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    index_keys: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """Causal top-k token indices per query, sorted ascending, padded with -1.

    index_q [T, Hi, Di], index_w [T, Hi], index_keys [C, Di] (rows 0..C-1 of ONE request's
    context, row s = token at position s), positions [T] with positions[t] < C.
    score[t, s] = sum_h index_w[t, h] * relu(index_q[t, h] . index_keys[s]) for s <= positions[t],
    in float32. Returns [T, topk] int64: the topk best visible tokens in ascending order; when at
    most topk tokens are visible, all of them, then -1. Equal scores prefer the later token, so the
    choice is a function of the visible scores alone (rows past a query's position, even NaN, never
    affect it). Queries are processed in chunks whose working set stays near
    ``chunk_bytes``; bitwise-equal results across engines need equal (T, C) shapes, like any matmul.
    """
    _check_indexer_inputs(index_q, index_w, index_keys, positions, topk)
    t_all, heads, _ = index_q.shape
    c = index_keys.shape[0]
    keys_t = index_keys.to(torch.float32).t()  # [Di, C]
    cols = torch.arange(c, device=index_keys.device)  # [C]
    out = torch.empty((t_all, topk), dtype=torch.long, device=index_keys.device)
    chunk = max(1, chunk_bytes // (max(c, 1) * (4 * heads + 56)))  # ~bytes per (query, key) pair
    for start in range(0, t_all, chunk):
        end = min(start + chunk, t_all)
        q = index_q[start:end].to(torch.float32)  # [t, Hi, Di]
        w = index_w[start:end].to(torch.float32)  # [t, Hi]
        logits = (q.reshape(-1, q.shape[-1]) @ keys_t).view(end - start, heads, c)  # [t, Hi, C]
        scores = (logits.relu_() * w[:, :, None]).sum(dim=1)  # [t, C]
        visible = cols[None, :] <= positions[start:end, None]  # [t, C]
        scores.masked_fill_(~visible, float("-inf"))
        out[start:end] = _select_topk(scores, visible, topk)
    return out


def batched_indexer_topk(
    index_q: torch.Tensor,
    index_w: torch.Tensor,
    index_keys: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
) -> torch.Tensor:
    """``indexer_topk`` for a batch of queries from different requests (decode).

    index_q [T, Hi, Di], index_w [T, Hi], index_keys [T, C, Di] (query t's own request's keys,
    rows beyond positions[t] ignored), positions [T] -> [T, topk] int64, same selection rule.
    """
    if index_keys.dim() != 3 or index_keys.shape[0] != index_q.shape[0]:
        raise ValueError(f"index_keys must be [T, C, Di] with T = {index_q.shape[0]}, got {tuple(index_keys.shape)}")
    _check_indexer_inputs(
        index_q,
        index_w,
        index_keys[0] if index_keys.shape[0] else index_keys.new_empty((0, index_q.shape[-1])),
        positions,
        topk,
    )
    t, heads, _ = index_q.shape
    c = index_keys.shape[1]
    logits = torch.bmm(index_q.to(torch.float32), index_keys.to(torch.float32).transpose(1, 2))  # [T, Hi, C]
    scores = (logits.relu_() * index_w.to(torch.float32)[:, :, None]).sum(dim=1)  # [T, C]
    visible = torch.arange(c, device=index_keys.device)[None, :] <= positions[:, None]  # [T, C]
    scores.masked_fill_(~visible, float("-inf"))
    return _select_topk(scores, visible, topk)


def _select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [t, C] (-inf where invisible), visible [t, C] -> [t, topk] ascending, -1 padded."""
    t, c = scores.shape
    kth = scores.topk(min(topk, c), dim=-1).values[:, -1:]  # [t, 1] k-th best score (-inf if few visible)
    above = scores > kth  # [t, C]
    ties = (scores == kth) & visible  # [t, C]
    need = min(topk, c) - above.sum(dim=-1, keepdim=True)  # [t, 1] ties still to take
    ties_at_or_after = ties.flip(-1).cumsum(-1).flip(-1)  # [t, C] #ties at index >= s
    chosen = above | (ties & (ties_at_or_after <= need))  # [t, C] latest ties win
    slot = torch.where(chosen, chosen.cumsum(-1) - 1, topk)  # [t, C] output column, topk = discard
    out = torch.full((t, topk + 1), -1, dtype=torch.long, device=scores.device)  # [t, topk + 1]
    cols = torch.arange(c, device=scores.device).expand(t, c)  # [t, C]
    out.scatter_(1, slot, cols)  # each kept column has exactly one writer
    return out[:, :topk]


def gather_rows(cache: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cache [C, W], indices [T, k] (-1 = none) -> (rows [T, k, W] in index order, valid [T, k])."""
    if cache.dim() != 2:
        raise ValueError(f"cache must be [C, W], got shape {tuple(cache.shape)}")
    if indices.dim() != 2 or indices.dtype != torch.long:
        raise ValueError(f"indices must be an int64 [T, k] tensor, got {indices.dtype} {tuple(indices.shape)}")
    if indices.numel() and int(indices.max()) >= cache.shape[0]:
        raise ValueError(f"index {int(indices.max())} is beyond the cache's {cache.shape[0]} rows")
    valid = indices >= 0  # [T, k]
    return cache[indices.clamp(min=0)], valid  # [T, k, W], [T, k]


def sparse_mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_rows: torch.Tensor,
    valid: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Absorbed MLA over gathered rows -> latent output [T, H, R] in q_latent's dtype.

    q_latent [T, H, R], q_rope [T, H, r], kv_rows [T, k, R + r] (c ++ k_pe, in top-k order),
    valid [T, k] bool. score = (q_latent . c + q_rope . k_pe) * softmax_scale, softmax over valid
    rows in float32, output = sum_k p * c. A query with no valid row gets zeros.
    """
    _check_attention_inputs(q_latent, q_rope, kv_rows, valid, softmax_scale)
    r_lat = q_latent.shape[-1]
    rows = kv_rows.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # [T, k, R + r], ours
    # invalid rows (stale or uninitialized slots, NaN included) become zeros, in place: one copy, not two
    torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device), out=rows)
    q = torch.cat((q_latent, q_rope), dim=-1).to(torch.float32)  # [T, H, R + r]
    scores = torch.bmm(q, rows.transpose(1, 2)) * softmax_scale  # [T, H, k]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [T, H, k]
    probs = torch.where(valid.any(dim=-1)[:, None, None], probs, 0.0)  # all-invalid rows: 0, not NaN
    out = torch.bmm(probs, rows[..., :r_lat])  # [T, H, R]
    return out.to(q_latent.dtype)


def _check_indexer_inputs(index_q, index_w, index_keys, positions, topk) -> None:
    if index_q.dim() != 3:
        raise ValueError(f"index_q must be [T, Hi, Di], got shape {tuple(index_q.shape)}")
    t, heads, dim = index_q.shape
    if tuple(index_w.shape) != (t, heads):
        raise ValueError(f"index_w must be [T, Hi] = [{t}, {heads}], got {tuple(index_w.shape)}")
    if index_keys.dim() != 2 or index_keys.shape[1] != dim:
        raise ValueError(f"index_keys must be [C, Di] with Di = {dim}, got {tuple(index_keys.shape)}")
    for name, x in (("index_q", index_q), ("index_w", index_w), ("index_keys", index_keys)):
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
    if positions.dim() != 1 or positions.shape[0] != t or positions.is_floating_point():
        raise ValueError(
            f"positions must be an integer [T] tensor with T = {t}, got {positions.dtype} {tuple(positions.shape)}"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    if t and int(positions.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
    if t and int(positions.max()) >= index_keys.shape[0]:
        raise ValueError(
            f"query position {int(positions.max())} needs indexer key rows 0..{int(positions.max())}, but index_keys "
            f"holds {index_keys.shape[0]}: write this chunk's index_k rows before selecting"
        )


def _check_attention_inputs(q_latent, q_rope, kv_rows, valid, softmax_scale) -> None:
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(
            f"q_latent [T, H, R] and q_rope [T, H, r] disagree: {tuple(q_latent.shape)} vs {tuple(q_rope.shape)}"
        )
    t, _, r_lat = q_latent.shape
    width = r_lat + q_rope.shape[-1]
    if kv_rows.dim() != 3 or kv_rows.shape[0] != t or kv_rows.shape[2] != width:
        raise ValueError(f"kv_rows must be [T, k, R + r] = [{t}, k, {width}], got {tuple(kv_rows.shape)}")
    if valid.dtype != torch.bool or tuple(valid.shape) != tuple(kv_rows.shape[:2]):
        raise ValueError(
            f"valid must be a bool [T, k] = {tuple(kv_rows.shape[:2])} tensor, got {valid.dtype} {tuple(valid.shape)}"
        )
    if not (q_latent.is_floating_point() and q_rope.is_floating_point() and kv_rows.is_floating_point()):
        raise ValueError("q_latent, q_rope and kv_rows must be floating tensors")
    if not (isinstance(softmax_scale, float) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a float > 0, got {softmax_scale!r}")
