"""Build a Llama model's PCA indexer from its own keys (training-free, as in Loki, NeurIPS 2024).

``build_indexer(model_dir, rank=..., calibration_tokens=...)``:

1. tokenizes the calibration files (``dsamodel.indexer_corpus.CALIBRATION``, in order), each
   contributing at most ``calibration_tokens / len(files)`` tokens from its start, cut into
   segments of ``segment_tokens`` (default: the model's ``max_position_embeddings``);
2. runs the model densely over each segment from position 0, as a prefill does, in chunks of
   ``chunk_tokens`` (<= 2048) over a growing per-layer KV (attention through torch's fused
   ``scaled_dot_product_attention``: ``attend_causal``'s result to rounding, several times faster
   at 8K rows), and accumulates per layer and KV head the second moment ``sum_t k_t k_t^T`` of the
   RoPE'd keys in float64. Uncentred: the basis keeping
   most of the keys' energy keeps most of every query-key dot product. Long segments matter: RoPE
   turns a key's low-frequency pairs by less than a full turn within a few thousand positions, so a
   basis fitted on positions 0..2047 misses keys at 2048..8191 (at 4K context, k = 512, rank 16 the
   median recall on docs/design.md rose from 0.915 to 0.935 with 4096-token segments);
3. per layer and KV head, one ``eigh`` in float64: the top-``rank`` eigenvectors, largest first,
   each signed so that its largest-magnitude entry is positive (a deterministic choice);
4. measures the built indexer's ``attention_recall`` on a held-out text (``indexer_corpus.HELD_OUT[0]``,
   ``recall_context`` tokens, k = ``index_topk``) and writes ``kvoffload-indexer.safetensors`` and
   ``kvoffload-indexer.json`` (``dsamodel.pca_indexer``) into ``out_dir``'s ``kvoffload-indexer/``
   (default: beside the weights).

No random numbers are drawn (the json's ``seed`` is null): the same files give the same bytes on the
same machine and thread count. ``progress(done, total, stage)`` is called as the work advances (one
unit per segment chunk and layer, one per layer's eigh, one for the recall measurement).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dsamodel.hf_tokenizer import HFTokenizer
from dsamodel.indexer_corpus import CALIBRATION, HELD_OUT, Source
from dsamodel.indexer_recall import attention_recall
from dsamodel.llama import LlamaLayer, LlamaModel, LlamaProjection
from dsamodel.llama_weights import llama_config, load_llama_weights
from dsamodel.pca_indexer import save_indexer

Progress = Callable[[int, int, str], None]

# SmolLM2-135M, held-out texts (docs/design.md, torch's module.py, numpy's fromnumeric.py), median recall
# of the dense attention mass at k = context / 8: rank 16 keeps 0.929-0.962 at 2K and 0.936-0.970 at 4K
# (exact top-k: 0.949-0.973 / 0.954-0.980); rank 8 drops to 0.913 / 0.921, rank 32 adds ~0.01 for
# twice the cache. Rank 16 is 48 indexer elements per token: 1/8 of the 384-element KV row.
DEFAULT_RANK = 16
# context / 8 at 4K; at 8K (context / 16) rank 16 still keeps 0.928-0.952
DEFAULT_INDEX_TOPK = 512
DEFAULT_CALIBRATION_TOKENS = 32768
DEFAULT_CHUNK_TOKENS = 2048
DEFAULT_RECALL_CONTEXT = 4096


def build_indexer(
    model_dir: str | Path,
    *,
    rank: int = DEFAULT_RANK,
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    index_topk: int = DEFAULT_INDEX_TOPK,
    segment_tokens: int | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    recall_context: int | None = DEFAULT_RECALL_CONTEXT,
    out_dir: str | Path | None = None,
    sources: Sequence[Source] = CALIBRATION,
    progress: Progress | None = None,
) -> Path:
    """Build and write the indexer of the Llama model in model_dir (module doc); returns the json's path."""
    config = llama_config(model_dir)
    segment = config.max_position_embeddings if segment_tokens is None else segment_tokens
    _check_args(rank, calibration_tokens, index_topk, segment, chunk_tokens, recall_context)
    if rank > config.head_dim or segment > config.max_position_embeddings:
        raise ValueError(
            f"rank ({rank}) must be <= head_dim ({config.head_dim}) and segment_tokens ({segment}) <= "
            f"max_position_embeddings ({config.max_position_embeddings})"
        )
    model = load_llama_weights(LlamaModel(config), model_dir)
    tokenizer = HFTokenizer.from_dir(model_dir)
    segments, files = calibration_segments(tokenizer, sources, calibration_tokens, segment)
    report = progress or (lambda done, total, stage: None)
    layers = config.num_hidden_layers
    forward = layers * sum(-(-int(s.numel()) // chunk_tokens) for s in segments)
    total = forward + layers + (1 if recall_context else 0)
    with torch.inference_mode():
        moments = key_moments(model, segments, chunk_tokens, lambda done: report(done, total, "calibration forward"))
        bases, kept = principal_bases(moments, rank, lambda done: report(forward + done, total, "eigh"))
        model.attach_indexer(bases, index_topk)
        if recall_context:
            report(forward + layers, total, "recall on held-out text")
        recall = _recall(model, tokenizer, recall_context, index_topk) if recall_context else None
    report(total, total, "done")
    meta = {
        "rank": rank,
        "index_topk": index_topk,
        "index_head_dim": config.num_key_value_heads * rank,
        "key_source": "RoPE'd keys of each KV head (uncentred second moment, float64 eigh)",
        "calibration": {
            "files": files,
            "tokens": sum(int(s.numel()) for s in segments),
            "segment_tokens": segment,
            "chunk_tokens": chunk_tokens,
            "seed": None,
        },
        "energy_kept": {"min": round(min(kept), 4), "median": round(sorted(kept)[len(kept) // 2], 4)},
        "model": {"config_sha256": _sha256(Path(model_dir) / "config.json"), "dtype": config.torch_dtype},
        "recall": recall,
    }
    out = Path(model_dir) if out_dir is None else Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return save_indexer(out, bases, meta)


def calibration_segments(
    tokenizer: HFTokenizer, sources: Sequence[Source], calibration_tokens: int, segment_tokens: int
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Token segments [<= segment_tokens] of the sources, each source's share from its start, and
    a record per source (name, sha256, tokens used)."""
    if not sources:
        raise ValueError("no calibration sources")
    share = -(-calibration_tokens // len(sources))
    segments, files = [], []
    for source in sources:
        ids = tokenizer.encode(source.text())[:share]
        if len(ids) < 2:
            raise ValueError(f"calibration text {source.name} is (nearly) empty")
        tokens = torch.tensor(ids, dtype=torch.long)
        segments += list(tokens.split(segment_tokens))
        files.append({"source": source.name, "sha256": source.sha256(), "tokens": len(ids)})
    return segments, files


def key_moments(
    model: LlamaModel, segments: list[torch.Tensor], chunk_tokens: int, progress: Callable[[int], None]
) -> torch.Tensor:
    """Per layer and KV head, sum over every segment token of k k^T (RoPE'd keys): [L, KV, hd, hd]
    float64. Each segment runs from position 0 in chunks of ``chunk_tokens`` over its own KV rows."""
    cfg = model.config
    kv, hd, layers = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    moments = torch.zeros((layers, kv, hd, hd), dtype=torch.float64)
    done = 0
    for tokens in segments:
        rows = torch.empty((layers, tokens.shape[0], cfg.kv_row_width), dtype=model.dtype, device=model.device)
        for start in range(0, tokens.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, tokens.shape[0])
            positions = torch.arange(start, end, device=model.device)  # [c]
            h = model.embed(tokens[start:end].to(model.device))  # [c, D]
            for i, layer in enumerate(model.layers):
                proj = layer.project(h, positions)
                rows[i, start:end] = proj.kv  # [c, W]
                keys = proj.kv[:, : kv * hd].to(device="cpu", dtype=torch.float64).reshape(-1, kv, hd)
                keys = keys.transpose(0, 1)  # [KV, c, hd]
                moments[i] += torch.matmul(keys.transpose(1, 2), keys)  # [KV, hd, hd]
                if i + 1 < layers:
                    h = layer.finish(h, _sdpa_causal(layer, proj, rows[i, :end], positions))
                done += 1
                progress(done)
    return moments


def _sdpa_causal(layer: LlamaLayer, proj: LlamaProjection, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``layer.attend_causal``'s result to rounding (1e-7 in float32, one bf16 ulp in bfloat16), through
    torch's fused attention: 4-8x faster at 8K rows on CPU, and the key statistics need no exact bits."""
    kv, hd, c = layer.self_attn.num_kv_heads, layer.self_attn.head_dim, rows.shape[0]
    keys = rows[:, : kv * hd].reshape(c, kv, hd).transpose(0, 1)[None]  # [1, KV, C, hd]
    values = rows[:, kv * hd :].reshape(c, kv, hd).transpose(0, 1)[None]  # [1, KV, C, hd]
    visible = torch.arange(c, device=rows.device)[None, :] <= positions[:, None]  # [t, C]
    out = F.scaled_dot_product_attention(
        proj.q.transpose(0, 1)[None], keys, values, attn_mask=visible, scale=layer.softmax_scale, enable_gqa=True
    )  # [1, H, t, hd]
    return out[0].transpose(0, 1)  # [t, H, hd]


def principal_bases(
    moments: torch.Tensor, rank: int, progress: Callable[[int], None]
) -> tuple[list[torch.Tensor], list[float]]:
    """[L, KV, hd, hd] second moments -> per layer the top-``rank`` eigenvectors [KV, hd, r] float32
    (largest first, signed deterministically), and the share of key energy kept per (layer, head)."""
    bases, kept = [], []
    for i, layer_moments in enumerate(moments):
        values, vectors = torch.linalg.eigh(layer_moments)  # ascending: [KV, hd], [KV, hd, hd]
        top = vectors[..., -rank:].flip(-1)  # [KV, hd, r]
        pivot = top.abs().argmax(dim=1, keepdim=True)  # [KV, 1, r]
        top = top * torch.sign(top.gather(1, pivot))  # largest-magnitude entry positive
        bases.append(top.to(torch.float32).contiguous())
        kept += (values[:, -rank:].sum(-1) / values.sum(-1)).tolist()
        progress(i + 1)
    return bases, kept


def _recall(model: LlamaModel, tokenizer: HFTokenizer, context: int, k: int) -> dict[str, Any]:
    source = HELD_OUT[0]
    ids = tokenizer.encode(source.text())[:context]
    result = attention_recall(model, torch.tensor(ids, dtype=torch.long), k)
    return {"text": source.name, "sha256": source.sha256(), **result}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_args(rank, calibration_tokens, index_topk, segment_tokens, chunk_tokens, recall_context) -> None:
    for name, value in (
        ("rank", rank),
        ("calibration_tokens", calibration_tokens),
        ("index_topk", index_topk),
        ("segment_tokens", segment_tokens),
        ("chunk_tokens", chunk_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if chunk_tokens > DEFAULT_CHUNK_TOKENS:
        raise ValueError(f"chunk_tokens must be <= {DEFAULT_CHUNK_TOKENS} (a prefill chunk), got {chunk_tokens}")
    if recall_context is not None and (not isinstance(recall_context, int) or recall_context < 2):
        raise ValueError(f"recall_context must be an int >= 2 or None, got {recall_context!r}")
