"""Grouped-query attention over Llama KV cache rows: pure functions an engine calls per layer.

A cache row (``LlamaConfig.kv_row_width`` W = 2 * KV * hd elements) is the token's RoPE'd K of
every KV head, flattened, then its V of every KV head. Query head h reads KV head
``h // (H // KV)`` (HF ``repeat_kv``'s order).

- ``gqa_attention``: each query over its own gathered rows [T, k, W] (the sparse path: rows in
  top-k order, ``valid`` marking real ones). Invalid rows may hold anything (stale slots, NaN):
  they contribute exactly nothing; a query with no valid row gets zeros.
- ``gqa_causal_attention``: each query i over the shared rows 0..positions[i] of one request
  [C, W] (the dense path of a prefill chunk), queries processed in chunks whose working set stays
  near ``chunk_bytes`` so T = C = 8192 runs in bounded memory.

Both compute scores, the softmax and the weighted sum in float32 and return the query dtype.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_BYTES = 128 << 20  # causal attention working set per query chunk


def gqa_attention(
    q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, num_kv_heads: int, scale: float
) -> torch.Tensor:
    """q [T, H, hd], rows [T, k, W], valid [T, k] bool -> [T, H, hd] in q's dtype (module doc)."""
    _check_rows(q, rows, num_kv_heads, rows_dim=3)
    if valid.dtype != torch.bool or tuple(valid.shape) != tuple(rows.shape[:2]):
        raise ValueError(
            f"valid must be a bool [T, k] = {list(rows.shape[:2])} tensor, got {valid.dtype} {list(valid.shape)}"
        )
    t, heads, hd = q.shape
    k, kv = rows.shape[1], num_kv_heads
    r = rows.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # [T, k, W], ours
    torch.where(valid[..., None], r, torch.zeros((), dtype=r.dtype, device=r.device), out=r)
    keys = r[..., : kv * hd].view(t, k, kv, hd).permute(0, 2, 3, 1)  # [T, KV, hd, k]
    values = r[..., kv * hd :].view(t, k, kv, hd).transpose(1, 2)  # [T, KV, k, hd]
    qg = q.to(torch.float32).reshape(t, kv, heads // kv, hd)  # [T, KV, G, hd]
    scores = torch.matmul(qg, keys) * scale  # [T, KV, G, k]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [T, KV, G, k]
    probs = torch.where(valid.any(dim=-1)[:, None, None, None], probs, 0.0)  # all-invalid: 0, not NaN
    out = torch.matmul(probs, values)  # [T, KV, G, hd]
    return out.reshape(t, heads, hd).to(q.dtype)


def gqa_causal_attention(
    q: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """q [T, H, hd], rows [C, W] (row s = the request's token at position s), positions [T] with
    positions[i] < C -> [T, H, hd] in q's dtype: query i attends over rows 0..positions[i]."""
    _check_rows(q, rows, num_kv_heads, rows_dim=2)
    t_all, heads, hd = q.shape
    kv, g = num_kv_heads, heads // num_kv_heads
    if positions.dim() != 1 or positions.shape[0] != t_all or positions.is_floating_point():
        raise ValueError(
            f"positions must be an integer [T] tensor with T = {t_all}, got {positions.dtype} {list(positions.shape)}"
        )
    out = torch.empty((t_all, heads, hd), dtype=q.dtype, device=q.device)
    if t_all == 0:
        return out
    lo, c_all = int(positions.min()), int(positions.max()) + 1
    if lo < 0 or c_all > rows.shape[0]:
        raise ValueError(f"positions must be in [0, {rows.shape[0]}) (the rows given), got [{lo}, {c_all - 1}]")
    r = rows[:c_all].to(torch.float32)  # [C, W]
    keys = r[:, : kv * hd].reshape(c_all, kv, hd).permute(1, 2, 0)  # [KV, hd, C]
    values = r[:, kv * hd :].reshape(c_all, kv, hd).transpose(0, 1)  # [KV, C, hd]
    cols = torch.arange(c_all, device=rows.device)  # [C]
    chunk = max(1, chunk_bytes // (c_all * heads * 12))  # scores, probs and the mask per (query, head, row)
    for start in range(0, t_all, chunk):
        end = min(start + chunk, t_all)
        pos = positions[start:end]  # [t]
        c = int(pos.max()) + 1
        qg = q[start:end].to(torch.float32).reshape(end - start, kv, g, hd).transpose(0, 1)  # [KV, t, G, hd]
        scores = torch.matmul(qg.reshape(kv, -1, hd), keys[..., :c]) * scale  # [KV, t*G, c]
        scores = scores.view(kv, end - start, g, c)  # [KV, t, G, c]
        visible = cols[None, :c] <= pos[:, None]  # [t, c]
        scores.masked_fill_(~visible[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [KV, t, G, c]
        o = torch.matmul(probs.view(kv, -1, c), values[:, :c])  # [KV, t*G, hd]
        out[start:end] = o.view(kv, end - start, g, hd).transpose(0, 1).reshape(end - start, heads, hd).to(q.dtype)
    return out


def _check_rows(q: torch.Tensor, rows: torch.Tensor, num_kv_heads: int, *, rows_dim: int) -> None:
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a floating [T, H, hd] tensor, got {q.dtype} {list(q.shape)}")
    t, heads, hd = q.shape
    if num_kv_heads < 1 or heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide the {heads} query heads")
    width = 2 * num_kv_heads * hd
    shape = "[T, k, W]" if rows_dim == 3 else "[C, W]"
    if rows.dim() != rows_dim or rows.shape[-1] != width or not rows.is_floating_point():
        raise ValueError(
            f"rows must be a floating {shape} tensor with W = {width}, got {rows.dtype} {list(rows.shape)}"
        )
    if rows_dim == 3 and rows.shape[0] != t:
        raise ValueError(f"rows must hold T = {t} queries' rows, got {list(rows.shape)}")
