"""The DSA model as plain modules, its forward split into the steps an engine calls per layer.

Per cache layer (base decoder layers, then MTP layers; ``layer.cache_index`` is the physical
index), for T tokens of one request at ``positions`` [T]::

    proj = layer.project(h, positions)                  # Projection: q_latent, q_rope, kv, index_*
    # engine: write proj.kv / proj.index_k rows at positions into caches it owns
    topk = indexer_topk(proj.index_q, proj.index_w, index_cache[:C], positions, cfg.index_topk)
    rows, valid = <engine gather of kv rows in topk order>   # e.g. gather_rows(kv_cache[:C], topk)
    lat = sparse_mla_attention(proj.q_latent, proj.q_rope, rows, valid, layer.softmax_scale)
    h = layer.finish(h, lat)

around ``h = model.embed(tokens)`` and ``logits = model.logits(h)``. ``project``, ``finish`` and
attention are per-token, so tokens of several requests may be concatenated there; the indexer
selects over one request's cache at a time. MTP depth j (DeepSeek-V3 / vLLM convention): token i's
input is ``model.mtp_input(h_prev_i, token_{i+j+1}, depth=j)`` where ``h_prev`` is
``model.final_norm(h)`` of the main model (depth 0) or ``model.mtp[j-1].shared_head.norm(h)``;
its logits are ``model.mtp_logits(h, depth=j)`` (the LM head is shared with ``lm_head``).
Parameters never require grad: this is an inference model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import nn

from dsamodel.attention import batched_indexer_topk, gather_rows, indexer_topk, sparse_mla_attention
from dsamodel.config import ModelConfig
from dsamodel.indexcodec import IndexCodec
from dsamodel.mla import MLAttention, Projection
from dsamodel.modules import RMSNorm, SwiGLU, embedding, linear
from dsamodel.tp import SOLO, TPGroup

__all__ = ["DSAModel", "DecoderLayer", "MTPLayer", "Projection"]


class DecoderLayer(nn.Module):
    """One decoder layer: input RMSNorm, MLA + indexer, post-attention RMSNorm, SwiGLU MLP."""

    def __init__(self, config: ModelConfig, cache_index: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.cache_index = cache_index
        self.softmax_scale = config.softmax_scale
        self.max_position_embeddings = config.max_position_embeddings
        self.hidden_size = config.hidden_size
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = MLAttention(config, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        self.tp: TPGroup = SOLO  # the ranks this layer is sharded over (dsamodel.tp.shard_model)

    def project(self, h: torch.Tensor, positions: torch.Tensor) -> Projection:
        """h [T, D] residual stream, positions [T] -> the layer's queries and cache rows."""
        self._check_hidden(h)
        _check_positions(positions, h.shape[0], self.max_position_embeddings)
        return self.self_attn.project(self.input_layernorm(h), positions)

    # ---- the attention an engine runs between project and finish (a Llama layer has the same) ----

    def select(self, proj: Projection, keys: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
        """The lightning indexer's causal top-k of one request's decoded indexer keys [C, Di] for the
        queries at ``positions`` [T] -> [T, topk] ascending, -1 padded."""
        return indexer_topk(proj.index_q, proj.index_w, keys, positions, topk)

    def select_batched(self, proj: Projection, keys: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
        """``select`` for one query per row of a decode batch, each over its own request's keys
        [T, C, Di] (rows past ``positions[t]`` ignored) -> [T, topk]."""
        return batched_indexer_topk(proj.index_q, proj.index_w, keys, positions, topk)

    def attend(self, proj: Projection, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Absorbed MLA over gathered latent rows [T, k, R + r] in top-k order -> latent [T, H, R]."""
        return sparse_mla_attention(proj.q_latent, proj.q_rope, rows, valid, self.softmax_scale)

    def prefill_attend(
        self, proj: Projection, rows: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, topk: int
    ) -> torch.Tensor:
        """A prefill chunk's attention over its request's rows [C, R + r] and decoded indexer keys
        [C, Di]: sparse, as DSA's prefill is (each query's top-k) -> latent [T, H, R]."""
        gathered, valid = gather_rows(rows, self.select(proj, keys, positions, topk))  # [T, k, R + r], [T, k]
        return self.attend(proj, gathered, valid)

    def finish(self, h: torch.Tensor, attn_latent: torch.Tensor) -> torch.Tensor:
        """h [T, D], attn_latent [T, H, R] -> W_UV, o_proj, residual, post-norm, MLP, residual -> [T, D]."""
        self._check_hidden(h)
        attn = self.self_attn
        expected = (h.shape[0], attn.num_heads, attn.kv_lora_rank)
        if tuple(attn_latent.shape) != expected:
            raise ValueError(f"attn_latent must be [T, H, R] = {list(expected)}, got {list(attn_latent.shape)}")
        if self.tp.size == 1:
            h = h + attn.output(attn_latent.to(h.dtype))  # [T, D]
            return h + self.mlp(self.post_attention_layernorm(h))  # [T, D]
        # this rank's heads and intermediate: float32 partial sums, reduced over the ranks (dsamodel.tp)
        h = h + self.tp.reduce(attn.output(attn_latent.to(h.dtype), partial=True)).to(h.dtype)  # [T, D]
        return h + self.tp.reduce(self.mlp(self.post_attention_layernorm(h), partial=True)).to(h.dtype)

    def _check_hidden(self, h: torch.Tensor) -> None:
        dtype = self.input_layernorm.weight.dtype
        if h.dim() != 2 or h.shape[1] != self.hidden_size or h.dtype != dtype:
            raise ValueError(f"h must be a {dtype} [T, {self.hidden_size}] tensor, got {h.dtype} {list(h.shape)}")


class SharedHead(nn.Module):
    """An MTP layer's output norm (its LM head is the model's shared ``lm_head``)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)


class MTPLayer(DecoderLayer):
    """A DeepSeek MTP module: ``eh_proj(cat(enorm(emb), hnorm(h_prev)))`` then a decoder layer."""

    def __init__(self, config: ModelConfig, cache_index: int, *, dtype: torch.dtype, device) -> None:
        super().__init__(config, cache_index, dtype=dtype, device=device)
        d = config.hidden_size
        self.enorm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, device=device)
        self.eh_proj = linear(2 * d, d, dtype=dtype, device=device)
        self.shared_head = SharedHead(config, dtype=dtype, device=device)

    def combine(self, embedded: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
        """embedded [T, D] (next tokens), h_prev [T, D] -> the layer's input [T, D]."""
        return self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(h_prev)), dim=-1))


class Backbone(nn.Module):
    """``model.*`` of the checkpoint: embeddings, all cache layers (base then MTP), final norm."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        n = config.num_hidden_layers
        self.layers = nn.ModuleList(
            [DecoderLayer(config, i, dtype=dtype, device=device) for i in range(n)]
            + [MTPLayer(config, n + j, dtype=dtype, device=device) for j in range(config.num_nextn_predict_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)


class DSAModel(nn.Module):
    """The whole model; its ``state_dict()`` keys are the HF checkpoint names."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        dtype = config.dtype if dtype is None else dtype
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
        self.config = config
        self.model = Backbone(config, dtype=dtype, device=device)
        self.lm_head = linear(config.hidden_size, config.vocab_size, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tp: TPGroup = SOLO  # dsamodel.tp.shard_model sets the group of a sharded model
        self.requires_grad_(False)

    # nn.ModuleList is not generic (its items are typed Module): Backbone fills it with the base
    # DecoderLayers, then the MTPLayers, which the casts below name.

    @property
    def index_codec(self) -> IndexCodec:
        """How the indexer keys are stored in caches (every layer's indexer has the same)."""
        return self.cache_layers[0].self_attn.indexer.codec

    @property
    def layers(self) -> tuple[DecoderLayer, ...]:
        """Base decoder layers, cache indices 0..num_hidden_layers-1."""
        return tuple(cast("Iterable[DecoderLayer]", self.model.layers[: self.config.num_hidden_layers]))

    @property
    def mtp(self) -> tuple[MTPLayer, ...]:
        """MTP layers, cache indices num_hidden_layers.. (one per prediction depth)."""
        return tuple(cast("Iterable[MTPLayer]", self.model.layers[self.config.num_hidden_layers :]))

    @property
    def cache_layers(self) -> tuple[DecoderLayer, ...]:
        """All layers owning a KV cache, in physical order (``cache_layers[i].cache_index == i``)."""
        return tuple(cast("Iterable[DecoderLayer]", self.model.layers))

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
        """h [T, D] after the last base layer -> normed [T, D] (the LM head's input, MTP's h_prev)."""
        return self.model.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, D] after the last base layer -> float32 logits [T, V]."""
        return self.lm_head(self.final_norm(h)).to(torch.float32)

    def mtp_input(self, h_prev: torch.Tensor, next_tokens: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """h_prev [T, D] (normed, see module doc), next_tokens [T] -> MTP layer ``depth``'s input [T, D]."""
        layer = self._mtp_layer(depth)
        if h_prev.dim() != 2 or h_prev.shape[0] != next_tokens.shape[0]:
            raise ValueError(
                f"h_prev [T, D] and next_tokens [T] disagree: {list(h_prev.shape)} vs {list(next_tokens.shape)}"
            )
        return layer.combine(self.embed(next_tokens), h_prev)

    def mtp_logits(self, h: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """h [T, D] after MTP layer ``depth`` -> float32 logits [T, V] through the shared lm_head."""
        return self.lm_head(self._mtp_layer(depth).shared_head.norm(h)).to(torch.float32)

    def _mtp_layer(self, depth: int) -> MTPLayer:
        if not 0 <= depth < self.config.num_nextn_predict_layers:
            num = self.config.num_nextn_predict_layers
            raise ValueError(f"MTP depth {depth} out of range: the model has {num} MTP layer(s)")
        return self.mtp[depth]


def _check_tokens(tokens: torch.Tensor, vocab_size: int) -> None:
    if tokens.dim() != 1 or tokens.is_floating_point() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be an integer [T] tensor, got {tokens.dtype} {list(tokens.shape)}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")


def _check_positions(positions: torch.Tensor, num_tokens: int, max_positions: int) -> None:
    if positions.dim() != 1 or positions.shape[0] != num_tokens or positions.is_floating_point():
        raise ValueError(
            f"positions must be an integer [T] tensor with T = {num_tokens}, "
            f"got {positions.dtype} {list(positions.shape)}"
        )
    if num_tokens and (int(positions.min()) < 0 or int(positions.max()) >= max_positions):
        raise ValueError(
            f"positions must be in [0, max_position_embeddings={max_positions}), "
            f"got [{int(positions.min())}, {int(positions.max())}]"
        )
