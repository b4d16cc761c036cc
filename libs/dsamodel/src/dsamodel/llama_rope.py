"""Llama's rotary position embedding, as HF transformers computes it (rotate-half layout).

The angles are computed in float32 (``inv_freq = 1 / theta ** (2i / d)``, times the position), their
cos/sin cast to the input dtype, and ``x * cos + rotate_half(x) * sin`` evaluated in that dtype: the
same operations as ``transformers``' ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``, so a
roped bf16 key here has HF's bits. (``dsamodel.rope`` is the DSA model's: float32 throughout.)
"""

from __future__ import annotations

import torch


def llama_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [T, n, d] (n heads) by the angles of positions [T] -> [T, n, d] in x's dtype."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=x.device).to(torch.float32) / d))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]  # [T, 1, d]
    rotated = torch.cat((-x[..., d // 2 :], x[..., : d // 2]), dim=-1)  # [T, n, d] rotate_half
    return x * cos + rotated * sin
