"""``SamplingParams``: one request's sampling settings as the engine's sampler takes them (greedy or
seeded temperature + top-p, penalties, ``min_tokens``, stop strings and ids, log-probabilities);
``choice_seed``: the seed of each choice of an ``n`` > 1 request.

A client's settings come from a checked body (``body_types``: ``request.sampling_params(choice)``),
which holds the API's types, limits and combinations. The constructor checks only what the sampler's
arithmetic needs of any caller, since benches, tests and the prefill build it directly: at least one
token, a finite temperature >= 0 (it divides the logits), a top-p in (0, 1] (0 would keep no token)
and a seed in [0, 2**63) (torch's generator and ``choice_seed``'s arithmetic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from openai_api.fields import MAX_SEED


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
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` of a request with ``n`` > 1 (choice 0 keeps the request's seed,
    so its first choice equals the n = 1 answer); the proxy's children and the prefill's first
    token derive it here alike."""
    return (seed + choice * 0x9E3779B97F4A7C15) % MAX_SEED
