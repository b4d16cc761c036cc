"""``SamplingParams``: one request's sampling settings as the engine's sampler takes them (greedy or
seeded temperature + top-p, penalties, ``min_tokens``, stop strings and ids, log-probabilities),
checked once at construction; ``choice_seed``: the seed of each choice of an ``n`` > 1 request."""

from __future__ import annotations

import math
from dataclasses import dataclass

from openai_api.fields import MAX_LOGPROBS, MAX_SEED


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; ``temperature == 0`` means greedy.

    ``logprobs``: None for none, else k >= 0 top alternatives per token (the chosen token's own
    log-probability is always returned).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        temperature = self.temperature
        if (
            isinstance(temperature, bool)
            or not isinstance(temperature, (int, float))
            or not (math.isfinite(temperature) and temperature >= 0)
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an int in [0, {MAX_LOGPROBS}], got {lp!r}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a request with ``n`` > 1 (choice 0 keeps the request's seed,
    so its first choice equals the n = 1 answer); the proxy's children and the prefill's first
    token derive it here alike."""
    return (seed + choice * 0x9E3779B97F4A7C15) % MAX_SEED
