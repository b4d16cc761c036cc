"""The PCA indexer: a training-free selector built from a Llama model's own keys (Loki, NeurIPS 2024).

Per layer and KV head g, ``basis[g]`` [hd, r] is an orthonormal basis of the top-r principal
directions of that head's RoPE'd keys (``dsamodel.indexer_build`` calibrates it). A token's indexer
key is ``index_k = concat_g(k_g . P_g)`` [KV * r] (the indexer cache row, in the model dtype); query
head h's indexer query is ``index_q_h = q_h . P_{g(h)}`` [r] (float32). A visible past token t is
scored by the approximate attention mass over the layer's query heads,
``sum_h softmax_t(scale * index_q_h . index_k_{g(h)}(t))`` in float32, and the layer's heads share
one top-k: ``pca_select`` (one request's keys, causal) and ``pca_select_batched`` (decode: one
query per request over its own keys). The output follows ``dsamodel.attention.indexer_topk``'s
convention exactly, as the engine expects: int64 [T, k], positions in ascending order, -1 padded
when fewer than k tokens are visible, equal scores preferring the later token.

On disk, in ``kvoffload-indexer/`` beside the weights (not at the top level, where loaders such as
vLLM's take every ``*.safetensors`` for weights): ``kvoffload-indexer.safetensors``
(``layers.{i}.basis`` [KV, hd, r] float32) and ``kvoffload-indexer.json`` (method, rank, index_topk,
calibration, recall).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dsamodel.attention import _select_topk

# in a folder of its own beside the weights: vLLM (and other loaders) load every *.safetensors at
# a model directory's top level as weights, and refuse a file that is not
INDEXER_DIR = "kvoffload-indexer"
INDEXER_WEIGHTS = f"{INDEXER_DIR}/kvoffload-indexer.safetensors"
INDEXER_META = f"{INDEXER_DIR}/kvoffload-indexer.json"
METHOD = "pca"
DEFAULT_CHUNK_BYTES = 128 << 20  # selection working set per query chunk


class PCAIndexer(nn.Module):
    """One layer's bases (a non-persistent buffer: not part of the HF checkpoint)."""

    basis: torch.Tensor  # [KV, hd, r] float32, orthonormal columns

    def __init__(self, num_kv_heads: int, head_dim: int, rank: int, *, device) -> None:
        super().__init__()
        self.num_kv_heads, self.head_dim, self.rank = num_kv_heads, head_dim, rank
        basis = torch.zeros((num_kv_heads, head_dim, rank), dtype=torch.float32, device=device)
        self.register_buffer("basis", basis, persistent=False)  # [KV, hd, r]

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """RoPE'd keys k [T, KV, hd] -> indexer keys [T, KV * r] in k's dtype."""
        t = k.shape[0]
        out = torch.matmul(k.to(torch.float32).transpose(0, 1), self.basis)  # [KV, T, r]
        return out.transpose(0, 1).reshape(t, self.num_kv_heads * self.rank).to(k.dtype)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """RoPE'd queries q [T, H, hd] -> indexer queries [T, H, r] float32."""
        t, heads, hd = q.shape
        kv = self.num_kv_heads
        qg = q.to(torch.float32).reshape(t, kv, heads // kv, hd).transpose(0, 1)  # [KV, T, G, hd]
        out = torch.matmul(qg.reshape(kv, -1, hd), self.basis)  # [KV, T*G, r]
        return out.view(kv, t, heads // kv, self.rank).transpose(0, 1).reshape(t, heads, self.rank)


def pca_select(
    index_q: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    scale: float,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """index_q [T, H, r], keys [C, KV * r] (ONE request's rows, row s = position s), positions [T]
    with positions[t] < C -> [T, topk] int64 (module doc), queries in chunks of ~``chunk_bytes``."""
    t_all, heads, rank = _check_select(index_q, keys, positions, topk, batched=False)
    kv = keys.shape[-1] // rank
    c = keys.shape[0]
    k_t = keys.to(torch.float32).reshape(c, kv, rank).permute(1, 2, 0)  # [KV, r, C]
    cols = torch.arange(c, device=keys.device)  # [C]
    out = torch.empty((t_all, topk), dtype=torch.long, device=keys.device)
    chunk = max(1, chunk_bytes // (max(c, 1) * (8 * heads + 56)))  # ~bytes per (query, key) pair
    for start in range(0, t_all, chunk):
        end = min(start + chunk, t_all)
        qg = index_q[start:end].to(torch.float32).reshape(end - start, kv, heads // kv, rank).transpose(0, 1)
        logits = torch.matmul(qg.reshape(kv, -1, rank), k_t) * scale  # [KV, t*G, C]
        logits = logits.view(kv, end - start, heads // kv, c).transpose(0, 1).reshape(end - start, heads, c)
        visible = cols[None, :] <= positions[start:end, None]  # [t, C]
        out[start:end] = _top_mass(logits, visible, topk)
    return out


def pca_select_batched(
    index_q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, topk: int, scale: float
) -> torch.Tensor:
    """index_q [N, H, r] (one query per request), keys [N, C, KV * r] (request n's own rows, those
    past positions[n] ignored), positions [N] -> [N, topk] int64, ``pca_select``'s rule."""
    n, heads, rank = _check_select(index_q, keys, positions, topk, batched=True)
    kv, c = keys.shape[-1] // rank, keys.shape[1]
    k_t = keys.to(torch.float32).reshape(n, c, kv, rank).permute(0, 2, 3, 1)  # [N, KV, r, C]
    qg = index_q.to(torch.float32).reshape(n, kv, heads // kv, rank)  # [N, KV, G, r]
    logits = (torch.matmul(qg, k_t) * scale).reshape(n, heads, c)  # [N, H, C]
    visible = torch.arange(c, device=keys.device)[None, :] <= positions[:, None]  # [N, C]
    return _top_mass(logits, visible, topk)


def _top_mass(logits: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """logits [t, H, C] float32, visible [t, C] -> top-k of the visible softmax mass summed over heads."""
    logits.masked_fill_(~visible[:, None, :], float("-inf"))
    scores = torch.softmax(logits, dim=-1).sum(dim=1)  # [t, C]
    scores.masked_fill_(~visible, float("-inf"))
    return _select_topk(scores, visible, topk)


def _check_select(index_q, keys, positions, topk, *, batched: bool) -> tuple[int, int, int]:
    if index_q.dim() != 3 or not index_q.is_floating_point():
        raise ValueError(f"index_q must be a floating [T, H, r] tensor, got {index_q.dtype} {list(index_q.shape)}")
    t, heads, rank = index_q.shape
    shape = "[N, C, KV * r]" if batched else "[C, KV * r]"
    if keys.dim() != (3 if batched else 2) or not keys.is_floating_point() or keys.shape[-1] % rank:
        raise ValueError(f"keys must be a floating {shape} tensor with r = {rank}, got {keys.dtype} {list(keys.shape)}")
    if heads % (keys.shape[-1] // rank) or (batched and keys.shape[0] != t):
        raise ValueError(f"keys {list(keys.shape)} do not fit index_q {list(index_q.shape)} ({shape})")
    if positions.dim() != 1 or positions.shape[0] != t or positions.is_floating_point():
        raise ValueError(
            f"positions must be an integer [T] tensor with T = {t}, got {positions.dtype} {list(positions.shape)}"
        )
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk must be an int >= 1, got {topk!r}")
    rows = keys.shape[-2]
    if t and (int(positions.min()) < 0 or int(positions.max()) >= rows):
        lo, hi = int(positions.min()), int(positions.max())
        raise ValueError(
            f"query positions [{lo}, {hi}] need key rows 0..{hi}, but keys hold {rows}: "
            "write this chunk's index_k rows before selecting"
        )
    return t, heads, rank


# ---- files beside the model ------------------------------------------------------------------------
def read_indexer_meta(model_dir: str | Path) -> dict[str, Any] | None:
    """``kvoffload-indexer.json`` of model_dir, or None when the model has no indexer."""
    model_dir = Path(model_dir)
    meta, weights = model_dir / INDEXER_META, model_dir / INDEXER_WEIGHTS
    if not meta.is_file() and not weights.is_file():
        return None
    if not (meta.is_file() and weights.is_file()):
        present, absent = (meta, weights) if meta.is_file() else (weights, meta)
        raise ValueError(f"{present} is there but {absent.name} is not: rebuild the indexer (kvoffload model fetch)")
    data = json.loads(meta.read_text())
    if not isinstance(data, dict) or data.get("method") != METHOD:
        raise ValueError(
            f"{meta}: method must be {METHOD!r}, got {data.get('method') if isinstance(data, dict) else data!r}"
        )
    for key in ("rank", "index_topk"):
        if isinstance(data.get(key), bool) or not isinstance(data.get(key), int) or data[key] < 1:
            raise ValueError(f"{meta}: {key} must be an int >= 1, got {data.get(key)!r}")
    return data


def load_bases(model_dir: str | Path, num_layers: int, shape: tuple[int, int, int]) -> list[torch.Tensor]:
    """Every layer's basis [KV, hd, r] from ``kvoffload-indexer.safetensors``, shapes checked."""
    path = Path(model_dir) / INDEXER_WEIGHTS
    tensors = load_file(str(path))
    names = [f"layers.{i}.basis" for i in range(num_layers)]
    wrong = sorted(set(tensors) ^ set(names)) + [
        f"{name}: {list(tensors[name].shape)}"
        for name in names
        if name in tensors and tuple(tensors[name].shape) != shape
    ]
    if wrong:
        raise ValueError(f"{path} does not fit the model (expected {num_layers} bases of {list(shape)}): {wrong[:8]}")
    return [tensors[name].to(torch.float32) for name in names]


def save_indexer(out_dir: str | Path, bases: list[torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write the bases and the metadata (deterministic bytes); returns the json's path."""
    out_dir = Path(out_dir)
    (out_dir / INDEXER_DIR).mkdir(parents=True, exist_ok=True)
    tensors = {f"layers.{i}.basis": b.to(torch.float32).contiguous() for i, b in enumerate(bases)}
    weights, path = out_dir / INDEXER_WEIGHTS, out_dir / INDEXER_META
    tmp_weights, tmp_meta = out_dir / (INDEXER_WEIGHTS + ".tmp"), out_dir / (INDEXER_META + ".tmp")
    path.unlink(missing_ok=True)  # a reader never pairs an old json with new bases
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})  # one key: safetensors orders them at random
    os.chmod(tmp_weights, 0o644)  # readable by every service, as the weights beside it
    os.replace(tmp_weights, weights)
    tmp_meta.write_text(json.dumps({**meta, "method": METHOD}, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_meta, path)  # last: the pair is complete once the json is there
    return path
