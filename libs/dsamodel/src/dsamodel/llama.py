"""A Llama model (GQA, RoPE, SwiGLU) in plain torch, its forward split into the steps an engine calls.

The same per-layer split as ``DSAModel`` (``dsamodel.model``). For T tokens of one request at
``positions`` [T], per layer (``layer.cache_index`` is the physical index)::

    proj = layer.project(h, positions)           # LlamaProjection: q, kv, index_q, index_k
    # engine: write proj.kv (and proj.index_k) rows at positions into caches it owns
    attn = layer.attend_causal(proj, kv_cache[:C], positions)          # dense (prefill chunk)
    # or sparse: topk = layer.select(proj, index_cache[:C], positions, k)
    #            rows, valid = <gather of kv rows in topk order>;  attn = layer.attend(proj, rows, valid)
    h = layer.finish(h, attn)

around ``h = model.embed(tokens)`` and ``logits = model.logits(h)``. The cache row is
``kv`` [T, W]: RoPE'd K of every KV head, then V of every KV head (``dsamodel.gqa``). The
indexer (``dsamodel.pca_indexer``, optional: ``model.has_indexer``) adds ``index_k`` [T, KV * r]
cache rows and ``index_q`` [T, H, r] queries. Module names follow HF Llama checkpoints, so
``state_dict()`` keys are the checkpoint names (the indexer bases are not in it). Inference only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from dsamodel.config import ModelConfig
from dsamodel.gqa import gqa_attention, gqa_causal_attention
from dsamodel.indexcodec import IndexCodec
from dsamodel.llama_config import LlamaConfig
from dsamodel.llama_rope import llama_rope
from dsamodel.model import _check_positions, _check_tokens
from dsamodel.modules import RMSNorm, SwiGLU, embedding, linear
from dsamodel.pca_indexer import PCAIndexer, pca_select, pca_select_batched
from dsamodel.tp import SOLO, TPGroup

__all__ = ["NO_INDEXER", "LlamaLayer", "LlamaModel", "LlamaProjection"]

NO_INDEXER = (
    "this Llama model has no indexer (no kvoffload-indexer/ folder beside its weights), so it cannot "
    "select tokens for sparse attention: build one with dsamodel.indexer_build.build_indexer (kvoffload model fetch)"
)


@dataclass(frozen=True)
class LlamaProjection:
    """What one layer's ``project`` hands the engine for T tokens."""

    q: torch.Tensor  # [T, H, hd] RoPE'd queries, model dtype
    kv: torch.Tensor  # [T, W = 2 * KV * hd] RoPE'd K of every KV head, then V: the cache row
    index_q: torch.Tensor | None  # [T, H, r] float32 indexer queries (None without an indexer)
    index_k: torch.Tensor | None  # [T, KV * r] indexer cache row, model dtype (None without an indexer)

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[0]


class LlamaAttention(nn.Module):
    """``self_attn``: q/k/v/o projections (HF names) and the optional PCA indexer."""

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        d, h, kv, hd = config.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = linear(d, h * hd, dtype=dtype, device=device)
        self.k_proj = linear(d, kv * hd, dtype=dtype, device=device)
        self.v_proj = linear(d, kv * hd, dtype=dtype, device=device)
        self.o_proj = linear(h * hd, d, dtype=dtype, device=device)
        self.pca_indexer: PCAIndexer | None = None  # LlamaModel.attach_indexer sets it

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> LlamaProjection:
        """x [T, D] (after input_layernorm) -> LlamaProjection."""
        t = x.shape[0]
        q = llama_rope(self.q_proj(x).view(t, self.num_heads, self.head_dim), positions, self.rope_theta)  # [T, H, hd]
        k = llama_rope(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), positions, self.rope_theta)
        v = self.v_proj(x)  # [T, KV*hd]
        kv = torch.cat((k.reshape(t, -1), v), dim=-1)  # [T, W]
        if self.pca_indexer is None:
            return LlamaProjection(q=q, kv=kv, index_q=None, index_k=None)
        return LlamaProjection(q=q, kv=kv, index_q=self.pca_indexer.queries(q), index_k=self.pca_indexer.keys(k))


class LlamaLayer(nn.Module):
    """One decoder layer: input RMSNorm, GQA attention, post-attention RMSNorm, SwiGLU MLP."""

    def __init__(self, config: LlamaConfig, cache_index: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.cache_index = cache_index
        self.softmax_scale = config.softmax_scale
        self.max_position_embeddings = config.max_position_embeddings
        self.hidden_size = config.hidden_size
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = LlamaAttention(config, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        self.tp: TPGroup = SOLO  # Llama is not sharded (dsamodel.tp.shard_model refuses it)

    def project(self, h: torch.Tensor, positions: torch.Tensor) -> LlamaProjection:
        """h [T, D] residual stream, positions [T] -> the layer's queries and cache rows."""
        self._check_hidden(h)
        _check_positions(positions, h.shape[0], self.max_position_embeddings)
        return self.self_attn.project(self.input_layernorm(h), positions)

    def attend(self, proj: LlamaProjection, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Each query over its gathered rows [T, k, W] (valid [T, k] bool) -> [T, H, hd]."""
        return gqa_attention(proj.q, rows, valid, self.self_attn.num_kv_heads, self.softmax_scale)

    def attend_causal(self, proj: LlamaProjection, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Query i over the request's rows [C, W] 0..positions[i] -> [T, H, hd] (the dense path)."""
        return gqa_causal_attention(proj.q, rows, positions, self.self_attn.num_kv_heads, self.softmax_scale)

    def prefill_attend(
        self, proj: LlamaProjection, rows: torch.Tensor, keys: torch.Tensor | None, positions: torch.Tensor, topk: int
    ) -> torch.Tensor:
        """A prefill chunk's attention over its request's rows [C, W]: dense (``attend_causal``). The
        model was trained dense; the indexer serves the decode's selection (its keys, ``keys``, and
        ``topk`` are not used here) -> [T, H, hd]."""
        return self.attend_causal(proj, rows, positions)

    def select(self, proj: LlamaProjection, keys: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
        """The indexer's causal top-k over one request's indexer rows keys [C, Di] -> [T, k] int64."""
        return pca_select(self._index_q(proj), keys, positions, k, self.softmax_scale)

    def select_batched(
        self, proj: LlamaProjection, keys: torch.Tensor, positions: torch.Tensor, k: int
    ) -> torch.Tensor:
        """Decode: query n over its own request's rows keys[n] [C, Di] 0..positions[n] -> [N, k] int64."""
        return pca_select_batched(self._index_q(proj), keys, positions, k, self.softmax_scale)

    def finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """h [T, D], attn [T, H, hd] -> o_proj, residual, post-norm, MLP, residual -> [T, D]."""
        self._check_hidden(h)
        a = self.self_attn
        expected = (h.shape[0], a.num_heads, a.head_dim)
        if tuple(attn.shape) != expected:
            raise ValueError(f"attn must be [T, H, hd] = {list(expected)}, got {list(attn.shape)}")
        h = h + a.o_proj(attn.to(h.dtype).reshape(h.shape[0], -1))  # [T, D]
        return h + self.mlp(self.post_attention_layernorm(h))  # [T, D]

    def _index_q(self, proj: LlamaProjection) -> torch.Tensor:
        if proj.index_q is None:
            raise ValueError(NO_INDEXER)
        return proj.index_q

    def _check_hidden(self, h: torch.Tensor) -> None:
        dtype = self.input_layernorm.weight.dtype
        if h.dim() != 2 or h.shape[1] != self.hidden_size or h.dtype != dtype:
            raise ValueError(f"h must be a {dtype} [T, {self.hidden_size}] tensor, got {h.dtype} {list(h.shape)}")


class LlamaBackbone(nn.Module):
    """``model.*`` of the checkpoint: embeddings, the decoder layers, the final norm."""

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            [LlamaLayer(config, i, dtype=dtype, device=device) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)


class LlamaModel(nn.Module):
    """The whole model; its ``state_dict()`` keys are the HF checkpoint names."""

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        dtype = config.dtype if dtype is None else dtype
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
        if config.has_indexer:
            raise ValueError("LlamaModel is built without an indexer: attach_indexer(bases, index_topk) adds one")
        self.config = config
        self.model = LlamaBackbone(config, dtype=dtype, device=device)
        self.lm_head = linear(config.hidden_size, config.vocab_size, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tp: TPGroup = SOLO
        self._codec: IndexCodec | None = None
        self.requires_grad_(False)

    def attach_indexer(self, bases: list[torch.Tensor], index_topk: int) -> LlamaModel:
        """Give every layer its PCA basis [KV, hd, r] (``dsamodel.pca_indexer``); the config gains
        ``index_rank`` r and the default ``index_topk``. Returns the model."""
        cfg = self.config
        if len(bases) != cfg.num_hidden_layers or any(b.dim() != 3 for b in bases):
            raise ValueError(f"bases must be {cfg.num_hidden_layers} tensors [KV, hd, r], got {len(bases)}")
        rank = bases[0].shape[-1]
        shape = (cfg.num_key_value_heads, cfg.head_dim, rank)
        wrong = [i for i, b in enumerate(bases) if tuple(b.shape) != shape]
        if wrong:
            raise ValueError(f"bases of layers {wrong[:8]} are not {list(shape)}")
        self.config = dataclasses.replace(cfg, index_rank=rank, index_topk=index_topk)
        for layer, basis in zip(self.layers, bases, strict=True):
            indexer = PCAIndexer(cfg.num_key_value_heads, cfg.head_dim, rank, device=self.device)
            indexer.basis.copy_(basis)
            layer.self_attn.pca_indexer = indexer
        # IndexCodec reads architectures, index_head_dim, torch_dtype and dtype, which LlamaConfig has
        self._codec = IndexCodec(cast("ModelConfig", self.config))
        return self

    @property
    def has_indexer(self) -> bool:
        return self._codec is not None

    @property
    def index_codec(self) -> IndexCodec:
        """How the indexer keys are stored in caches: plain rows in the model dtype."""
        if self._codec is None:
            raise ValueError(NO_INDEXER)
        return self._codec

    @property
    def layers(self) -> tuple[LlamaLayer, ...]:
        return tuple(cast("Iterable[LlamaLayer]", self.model.layers))

    @property
    def cache_layers(self) -> tuple[LlamaLayer, ...]:
        """Every layer owns a KV cache (``cache_layers[i].cache_index == i``)."""
        return self.layers

    @property
    def mtp(self) -> tuple[()]:
        return ()

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> h [T, D]."""
        _check_tokens(tokens, self.config.vocab_size)
        return self.model.embed_tokens(tokens)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, D] after the last layer -> float32 logits [T, V]."""
        return self.lm_head(self.final_norm(h)).to(torch.float32)
