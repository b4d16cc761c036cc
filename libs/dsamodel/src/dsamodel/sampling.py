"""Token sampling: greedy, or seeded temperature + top-p with one generator per request, plus the
OpenAI controls that shape a sequence: presence/frequency penalties, ``min_tokens``, stop strings
and stop token ids, and log-probabilities.

Sampling runs on the CPU in float32/float64 from the logits row alone, so the same request
(seed, logits sequence) draws the same tokens on any device and in any batch composition.

Order of operations for one token (``RequestSampler.step``):

1. log-probabilities (when asked for) are ``log_softmax`` of the model's raw logits row — before
   penalties, temperature and top-p: the model's own distribution, as OpenAI reports it;
2. penalties over the tokens generated so far: ``logit[t] -= presence * (count[t] > 0) +
   frequency * count[t]``;
3. while fewer than ``min_tokens`` tokens exist, EOS and the stop token ids are banned;
4. greedy (``temperature == 0``) or seeded temperature + top-p draw.

A sequence ends with ``"eos"`` (EOS, unless ``ignore_eos``), ``"stop"`` (a stop token id, or the
generated text now contains a stop string; never before ``min_tokens``) or ``"length"``.
The request-side types are torch-free and live in ``openai_api``: ``SamplingParams`` (the settings),
``TokenLogprob`` (what ``token_logprob`` returns) and ``StopText`` (the stop-string matcher the
sampler ends a sequence with, as the output layer cuts the client's text with it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from openai_api.logprobs import TokenLogprob
from openai_api.sampling_params import SamplingParams
from openai_api.stop_text import StopText


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``TokenLogprob`` of ``token`` under logits [V] (float32 log_softmax), with the top ``k``."""
    lp = torch.log_softmax(logits.detach().to("cpu", torch.float32), dim=-1)  # [V]
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, ids = torch.topk(lp, min(k, lp.numel()))  # [k], [k]
        top = tuple((int(i), float(v)) for i, v in zip(ids, vals))
    return TokenLogprob(int(token), float(lp[token]), top)


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
    """One request's sampling state: its own seeded generator and the tokens drawn so far.

    ``detokenize(ids) -> text`` finds stop strings (default: the byte tokenizer's decode, specials
    skipped).
    """

    params: SamplingParams
    eos_token_id: int | None = None
    output_ids: list[int] = field(default_factory=list)
    detokenize: Callable[[list[int]], str] | None = None

    def __post_init__(self) -> None:
        self._generator = torch.Generator(device="cpu").manual_seed(self.params.seed)
        self.logprobs: list[TokenLogprob] = []  # one per output token when params.logprobs is not None
        self._counts: Counter[int] = Counter(self.output_ids)
        self._stopped = False  # a stop string or stop token id ended the sequence
        self._text: StopText | None = None
        if self.params.stop:
            if self.detokenize is None:
                from dsamodel.tokenizer import ByteTokenizer  # the engine's tokenizer

                tok = ByteTokenizer()
                self.detokenize = lambda ids: tok.decode(ids, skip_special_tokens=True)
            self._text = StopText(self.detokenize, self.params.stop, min_tokens=self.params.min_tokens)

    @property
    def finish_reason(self) -> str | None:
        """``"eos"``, ``"stop"``, ``"length"`` or None while the request may continue."""
        if self._stopped:
            return "stop"
        if self.output_ids and not self.params.ignore_eos and self.output_ids[-1] == self.eos_token_id:
            return "eos"
        if len(self.output_ids) >= self.params.max_tokens:
            return "length"
        return None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _banned(self) -> list[int]:
        if len(self.output_ids) >= self.params.min_tokens:
            return []
        banned = list(self.params.stop_token_ids)
        if self.eos_token_id is not None:
            banned.append(self.eos_token_id)
        return banned

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] after penalties and the ``min_tokens`` ban (float32 on the CPU)."""
        row = logits.detach().to("cpu", torch.float32)
        p = self.params
        banned = [t for t in self._banned() if 0 <= t < row.numel()]
        if not (p.penalized and self._counts) and not banned:
            return row
        row = row.clone()
        if p.penalized and self._counts:
            ids = torch.tensor(list(self._counts), dtype=torch.long)
            counts = torch.tensor([self._counts[i] for i in self._counts], dtype=torch.float32)
            row[ids] -= p.presence_penalty + p.frequency_penalty * counts
        if banned:
            row[torch.tensor(banned, dtype=torch.long)] = float("-inf")
        return row

    def step(self, logits: torch.Tensor) -> int:
        """Draw the next token from logits [V], record it and return it."""
        if self.finished:
            raise ValueError(f"request already finished ({self.finish_reason}); do not sample past it")
        _check_logits(logits)
        row = self.adjusted(logits)
        if self.params.temperature == 0:
            token = greedy(row)
        else:
            token = sample_top_p(row, self.params.temperature, self.params.top_p, self._generator)
        lp = token_logprob(logits, token, self.params.logprobs) if self.params.logprobs is not None else None
        self._record(token, lp)
        return token

    def accept(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """Record a token sampled elsewhere with these same params (the prefill's first token): the
        generator advances as if it had drawn it, so the rest matches a single-process run."""
        if self.finished:
            raise ValueError(f"request already finished ({self.finish_reason}); do not sample past it")
        if self.params.temperature != 0:
            torch.rand((), generator=self._generator, dtype=torch.float64)
        self._record(int(token), logprob)

    def _record(self, token: int, lp: TokenLogprob | None) -> None:
        self.output_ids.append(token)
        self._counts[token] += 1
        if lp is not None:
            self.logprobs.append(lp)
        if self._text is not None:
            self._text.add(token)
            self._stopped = self._text.stop_at >= 0
        if len(self.output_ids) >= self.params.min_tokens and token in self.params.stop_token_ids:
            self._stopped = True


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 1 or not logits.is_floating_point() or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty floating [V] tensor, got {logits.dtype} {list(logits.shape)}")
