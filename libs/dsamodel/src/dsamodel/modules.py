"""Small building blocks: RMSNorm, the indexer's LayerNorm and the dense SwiGLU MLP.

Norms compute in float32 and return the input dtype (HF DeepSeek-V3 convention). Linear layers and
the embedding are created uninitialized (``linear``, ``embedding``): weights come from a checkpoint
or ``presets.init_weights``. Not through ``torch.nn.utils.skip_init``: it builds the module on the
meta device first, whose ``normal_`` imports torch._dynamo — seconds of CPU at every process start.

A token's row never depends on how many rows share its product (``batch_rows``): a decode step of
one request gives the bytes the same request gets in a batch of eight, and a one-token prefill chunk
those of a longer one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

INDEXER_LAYERNORM_EPS = 1e-6  # DeepSeek-V3.2's indexer k_norm (a LayerNorm with bias)


# Measured with torch 2.13 on the CPU: its bfloat16 GEMM (oneDNN) computes a product of one row with
# another kernel than a product of two rows or more, and rounds about one output in a few hundred
# differently in its last bit, while the rows of a product of 2..2048 rows equal each other's. A
# batch of one request and a batch of several then part at a near tie of the greedy choice (a
# request's tokens depended on who shared its decode batch, I3). float32 GEMMs (MKL) round a row
# differently at several batch sizes, so one row made two would not help them: left alone.
ONE_ROW_AS_TWO = (torch.bfloat16,)


def batch_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for ``x`` [T, ...] whose rows ``fn`` maps one to one onto [T, ...]; a single row of a
    dtype in ``ONE_ROW_AS_TWO`` goes through ``fn`` as two equal rows, and the first comes back, so
    the row is computed as in any batch."""
    if x.shape[0] != 1 or x.dtype not in ONE_ROW_AS_TWO:
        return fn(x)
    return fn(torch.cat((x, x)))[:1]


class _UninitLinear(nn.Linear):
    def reset_parameters(self) -> None:  # the weight stays as torch.empty made it
        pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]; a row's bytes are those it gets in any batch (``batch_rows``)."""
        return batch_rows(super().forward, x)


class _UninitEmbedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


def linear(in_features: int, out_features: int, *, dtype: torch.dtype, device: torch.device | str | None) -> nn.Linear:
    """A bias-free ``nn.Linear`` whose weight [out, in] is left uninitialized."""
    device = torch.device("cpu") if device is None else torch.device(device)
    return _UninitLinear(in_features, out_features, bias=False, dtype=dtype, device=device)


def embedding(num: int, dim: int, *, dtype: torch.dtype, device: torch.device | str | None) -> nn.Embedding:
    """An ``nn.Embedding`` [num, dim] whose weight is left uninitialized."""
    device = torch.device("cpu") if device is None else torch.device(device)
    return _UninitEmbedding(num, dim, dtype=dtype, device=device)


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))`` with the normalization in float32."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)  # [..., D]
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class IndexerLayerNorm(nn.Module):
    """LayerNorm with weight and bias, computed in float32 (the indexer's ``k_norm``)."""

    def __init__(self, dim: int, *, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(
            x.to(torch.float32),
            (x.shape[-1],),
            self.weight.to(torch.float32),
            self.bias.to(torch.float32),
            INDEXER_LAYERNORM_EPS,
        )
        return out.to(x.dtype)


class SwiGLU(nn.Module):
    """Dense MLP ``down(silu(gate(x)) * up(x))`` (DeepSeek's MoE is replaced by this everywhere)."""

    def __init__(self, hidden: int, intermediate: int, *, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.gate_proj = linear(hidden, intermediate, dtype=dtype, device=device)
        self.up_proj = linear(hidden, intermediate, dtype=dtype, device=device)
        self.down_proj = linear(intermediate, hidden, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, *, partial: bool = False) -> torch.Tensor:
        """x [T, D] -> [T, D]; ``partial``: this TP rank's share of down_proj, in float32, to be
        summed over the ranks (``dsamodel.tp``)."""
        a = F.silu(self.gate_proj(x)) * self.up_proj(x)  # [T, I]
        if partial:
            return F.linear(a.to(torch.float32), self.down_proj.weight.to(torch.float32))  # [T, D]
        return self.down_proj(a)  # [T, D]
