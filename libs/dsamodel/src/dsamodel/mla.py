"""Per-layer projections: MLA with a compressed latent KV, and the lightning indexer.

Module and parameter names follow HF DeepSeek-V3.2 checkpoints (``self_attn.q_a_proj``,
``self_attn.indexer.wq_b``, ...), so ``state_dict()`` keys are the checkpoint names.

MLA in absorbed form (R = kv_lora_rank, r = qk_rope_head_dim, n = qk_nope_head_dim, v = v_head_dim):
``kv_b_proj.weight`` [H*(n+v), R] splits per head into W_UK [H, n, R] and W_UV [H, v, R]. A query's
``q_nope`` is pushed through W_UK into latent space (``q_latent`` [T, H, R]), so attention scores are
``q_latent . c + q_rope . k_pe`` against the cache row ``c ++ k_pe`` [R + r] shared by all heads,
and the attention output stays latent until ``output`` applies W_UV and ``o_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsamodel.config import ModelConfig
from dsamodel.indexcodec import IndexCodec
from dsamodel.modules import IndexerLayerNorm, RMSNorm, batch_rows, linear
from dsamodel.rope import apply_rope


@dataclass(frozen=True)
class Projection:
    """What one layer's ``project`` hands the engine for T tokens.

    The engine stores ``kv`` (main latent cache row) and ``index_k`` (indexer cache row) at the
    tokens' positions, selects with ``indexer_topk(index_q, index_w, <indexer cache>, ...)``,
    gathers ``kv`` rows in top-k order and calls ``sparse_mla_attention(q_latent, q_rope, ...)``.
    """

    q_latent: torch.Tensor  # [T, H, R] q_nope absorbed through W_UK
    q_rope: torch.Tensor  # [T, H, r] RoPE applied
    kv: torch.Tensor  # [T, R + r] kv_a_layernorm(c_kv) ++ RoPE'd k_pe: the main cache row
    index_q: torch.Tensor  # [T, Hi, Di] RoPE'd indexer queries
    index_w: torch.Tensor  # [T, Hi] float32 indexer head weights, scales folded in
    index_k: torch.Tensor  # [T, Di] the indexer cache row

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[0]


class Indexer(nn.Module):
    """Lightning indexer: per-token key ``index_k`` and per-query heads ``index_q`` + weights ``index_w``."""

    def __init__(self, config: ModelConfig, q_in_features: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.codec = IndexCodec(config)  # how the keys are stored in caches (plain or fp8 + scales)
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.rope_theta = config.rope_theta
        self.weight_scale = config.index_n_heads**-0.5 * config.index_head_dim**-0.5
        self.wq_b = linear(q_in_features, self.n_heads * self.head_dim, dtype=dtype, device=device)
        self.wk = linear(config.hidden_size, self.head_dim, dtype=dtype, device=device)
        self.k_norm = IndexerLayerNorm(self.head_dim, dtype=dtype, device=device)
        self.weights_proj = linear(config.hidden_size, self.n_heads, dtype=dtype, device=device)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE on the first ``rope_dim`` dims of x [T, h, Di]."""
        rotated = apply_rope(x[..., : self.rope_dim], positions, self.rope_theta, interleaved=False)  # [T, h, r]
        return torch.cat((rotated, x[..., self.rope_dim :]), dim=-1)  # [T, h, Di]

    def project(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor):
        """x [T, D] normed hidden, qr [T, q_in] query latent -> (index_q, index_w, index_k)."""
        t = x.shape[0]
        index_q = self._rope(self.wq_b(qr).view(t, self.n_heads, self.head_dim), positions)  # [T, Hi, Di]
        index_k = self._rope(self.k_norm(self.wk(x))[:, None, :], positions)[:, 0]  # [T, Di]
        index_w = self.weights_proj(x).to(torch.float32) * self.weight_scale  # [T, Hi]
        return index_q, index_w, index_k


class MLAttention(nn.Module):
    """Multi-head latent attention projections (``self_attn`` of a decoder layer)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_theta = config.rope_theta
        h, d = config.num_attention_heads, config.hidden_size
        if config.q_lora_rank is None:
            self.q_proj = linear(d, h * config.qk_head_dim, dtype=dtype, device=device)
        else:
            self.q_a_proj = linear(d, config.q_lora_rank, dtype=dtype, device=device)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype=dtype, device=device)
            self.q_b_proj = linear(config.q_lora_rank, h * config.qk_head_dim, dtype=dtype, device=device)
        self.kv_a_proj_with_mqa = linear(d, config.kv_row_width, dtype=dtype, device=device)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps, dtype=dtype, device=device)
        self.kv_b_proj = linear(config.kv_lora_rank, h * (self.nope_dim + self.v_dim), dtype=dtype, device=device)
        self.o_proj = linear(h * self.v_dim, d, dtype=dtype, device=device)
        q_in = d if config.q_lora_rank is None else config.q_lora_rank
        self.indexer = Indexer(config, q_in, dtype=dtype, device=device)

    # ---- pieces shared by the absorbed path and the naive reference ----------------------------
    def queries(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, D] -> (q_nope [T, H, n], q_rope [T, H, r], qr [T, q_in]: the indexer's query input)."""
        t = x.shape[0]
        if hasattr(self, "q_proj"):
            qr = x  # [T, D]
            q = self.q_proj(x)  # [T, H*(n+r)]
        else:
            qr = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank]
            q = self.q_b_proj(qr)  # [T, H*(n+r)]
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)  # [T, H, n+r]
        q_rope = apply_rope(q[..., self.nope_dim :], positions, self.rope_theta, interleaved=True)  # [T, H, r]
        return q[..., : self.nope_dim], q_rope, qr

    def latent_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> the cache row kv [T, R + r] = kv_a_layernorm(c_kv) ++ RoPE'd k_pe."""
        ckv = self.kv_a_proj_with_mqa(x)  # [T, R + r]
        c = self.kv_a_layernorm(ckv[:, : self.kv_lora_rank])  # [T, R]
        k_pe = apply_rope(ckv[:, None, self.kv_lora_rank :], positions, self.rope_theta, interleaved=True)  # [T, 1, r]
        return torch.cat((c, k_pe[:, 0]), dim=-1)  # [T, R + r]

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: (W_UK [H, n, R], W_UV [H, v, R])."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)  # [H, n+v, R]
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    # ---- absorbed path ----------------------------------------------------------------------------
    def project(self, x: torch.Tensor, positions: torch.Tensor) -> Projection:
        """x [T, D] (after input_layernorm) -> Projection."""
        q_nope, q_rope, qr = self.queries(x, positions)  # [T, H, n], [T, H, r], [T, q_in]
        w_uk, _ = self.w_uk_uv()  # [H, n, R]
        q_latent = batch_rows(lambda q: torch.bmm(q.transpose(0, 1), w_uk).transpose(0, 1), q_nope)  # [T, H, R]
        q_latent = q_latent.contiguous()
        index_q, index_w, index_k = self.indexer.project(x, qr, positions)
        return Projection(
            q_latent=q_latent,
            q_rope=q_rope.contiguous(),
            kv=self.latent_kv(x, positions),
            index_q=index_q,
            index_w=index_w,
            index_k=index_k,
        )

    def output(self, attn_latent: torch.Tensor, *, partial: bool = False) -> torch.Tensor:
        """attn_latent [T, H, R] -> W_UV up-projection and o_proj -> [T, D]; ``partial``: this TP
        rank's heads' share of o_proj, in float32, to be summed over the ranks."""
        t = attn_latent.shape[0]
        _, w_uv = self.w_uk_uv()  # [H, v, R]
        o = batch_rows(lambda a: torch.bmm(a.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1), attn_latent)
        o = o.reshape(t, self.num_heads * self.v_dim)  # [T, H*v]
        if partial:
            return F.linear(o.to(torch.float32), self.o_proj.weight.to(torch.float32))  # [T, D]
        return self.o_proj(o)  # [T, D]
