"""Token sampling: greedy, or seeded temperature + top-p with one generator per request.

Sampling runs on the CPU in float32/float64 from the logits row alone, so the same request
(seed, logits sequence) draws the same tokens on any device and in any batch composition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        temperature = self.temperature
        if not isinstance(temperature, (int, float)) or not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")


def greedy(logits: torch.Tensor) -> int:
    """logits [V] -> the arg-max token id (the first one on ties)."""
    _check_logits(logits)
    return int(torch.argmax(logits.detach().to("cpu", torch.float32)))


def sample_top_p(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """logits [V] -> a token drawn from the smallest top-probability set with mass >= top_p."""
    _check_logits(logits)
    probs = torch.softmax(logits.detach().to("cpu", torch.float32) / temperature, dim=-1)  # [V]
    sorted_p, order = torch.sort(probs, descending=True, stable=True)  # [V]
    kept = torch.where(sorted_p.cumsum(0) - sorted_p < top_p, sorted_p, 0.0).to(torch.float64)  # [V]
    cdf = kept.cumsum(0)  # [V]
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True).clamp(max=int((kept > 0).sum()) - 1))
    return int(order[i])


@dataclass
class RequestSampler:
    """One request's sampling state: its own seeded generator and the tokens drawn so far."""

    params: SamplingParams
    eos_token_id: int | None = None
    output_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(self.params.seed)

    @property
    def finish_reason(self) -> str | None:
        """``"eos"``, ``"length"`` or None while the request may continue."""
        if self.output_ids and not self.params.ignore_eos and self.output_ids[-1] == self.eos_token_id:
            return "eos"
        if len(self.output_ids) >= self.params.max_tokens:
            return "length"
        return None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def step(self, logits: torch.Tensor) -> int:
        """Draw the next token from logits [V], record it and return it."""
        if self.finished:
            raise ValueError(f"request already finished ({self.finish_reason}); do not sample past it")
        if self.params.temperature == 0:
            token = greedy(logits)
        else:
            token = sample_top_p(logits, self.params.temperature, self.params.top_p, self._generator)
        self.output_ids.append(token)
        return token


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 1 or not logits.is_floating_point() or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty floating [V] tensor, got {logits.dtype} {list(logits.shape)}")
