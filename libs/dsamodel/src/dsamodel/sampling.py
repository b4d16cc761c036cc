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
``StopText`` turns the output tokens into the text a client sees: everything before the first stop
string, released in pieces that never contain (a prefix of) a stop string still undecided.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

MAX_LOGPROBS = 20  # top alternatives per token, the OpenAI chat limit


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
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
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


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the ``k`` most likely tokens (ids, log-probs), best
    first, all from ``log_softmax`` of the model's raw logits."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


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


def find_stop(text: str, stop: tuple[str, ...], after: int = 0) -> int:
    """Index in ``text`` where the earliest stop string begins, among those ending past ``after``
    chars (occurrences ending at or before it are ignored), or -1."""
    hits = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stop) if i >= 0]
    return min(hits) if hits else -1


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
        if self.params.stop and self.detokenize is None:
            from dsamodel.tokenizer import ByteTokenizer  # the engine's tokenizer

            tok = ByteTokenizer()
            self.detokenize = lambda ids: tok.decode(ids, skip_special_tokens=True)
        self._text = (StopText(self.detokenize, self.params.stop, min_tokens=self.params.min_tokens)
                      if self.params.stop else None)

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


def _is_byte(token: int) -> bool:
    return 0 <= token < 256  # the byte tokenizer: ids 0..255 are UTF-8 bytes, the rest specials


class StopText:
    """Output tokens -> client text, cut before the first stop string (byte tokenizer ids).

    ``add(token, extra)`` then ``take()`` returns ``(text, [(token, extra), ...])``: the text and the
    tokens that may be shown now. Text that could still become a stop string (a suffix equal to a
    stop string's prefix) or an unfinished UTF-8 character is held back until decided;
    ``take(final=True)`` releases the rest. Once a stop string appeared, nothing at or after it is
    ever released, and neither are the tokens whose text reaches into it. A stop string counts
    only when it ends in the text of token ``min_tokens`` or later.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (), *,
                 min_tokens: int = 0) -> None:
        self._decode, self.stop, self.min_tokens = decode, tuple(stop), min_tokens
        self.ids: list[int] = []
        self._extra: list[Any] = []
        self._ends: list[int] = []  # per token: length of the stable text up to and including it
        self._base, self._base_text = 0, ""  # a prefix of ids whose text is final (ends at a boundary)
        self._checked = 0  # text length whose stop strings were ruled out
        self._sent_tokens = self._sent_chars = 0
        self.stop_at = -1  # index in the text where a stop string begins, once seen
        self.text = ""

    def _stable_len(self) -> int:
        """Length of the text without a trailing unfinished UTF-8 sequence."""
        ids, k, tail = self.ids, len(self.ids), 0
        while k > self._base and tail < 3 and _is_byte(ids[k - 1]) and 0x80 <= ids[k - 1] < 0xC0:
            k, tail = k - 1, tail + 1
        if k > self._base and _is_byte(ids[k - 1]) and ids[k - 1] >= 0xC0:
            lead = ids[k - 1]
            need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            if tail + 1 < need:
                return len(self._base_text) + len(self._decode(ids[self._base : k - 1]))
        return len(self.text)

    def add(self, token: int, extra: Any = None) -> None:
        token = int(token)
        self.ids.append(token)
        self._extra.append(extra)
        self.text = self._base_text + self._decode(self.ids[self._base :])
        stable = self._stable_len()
        if stable == len(self.text):  # no unfinished character at the end: this text is final
            self._base, self._base_text = len(self.ids), self.text
        self._ends.append(stable)
        if self.stop_at < 0 and self.stop:
            if len(self.ids) >= self.min_tokens:
                self.stop_at = find_stop(self.text, self.stop, self._checked)
            self._checked = stable

    @property
    def stable_len(self) -> int:
        """Length of the text whose characters are final (no unfinished UTF-8 at its end)."""
        return self._ends[-1] if self._ends else 0

    def _held(self, text: str) -> int:
        """Chars at the end of ``text`` that are a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def take(self, final: bool = False) -> tuple[str, list[tuple[int, Any]]]:
        if self.stop_at >= 0:
            limit = self.stop_at
        elif final:
            limit = len(self.text)
        else:
            stable = self.text[: self._ends[-1]] if self._ends else ""
            limit = len(stable) - self._held(stable)
        limit = max(limit, self._sent_chars)
        piece = self.text[self._sent_chars : limit]
        self._sent_chars = limit
        tokens = []
        while self._sent_tokens < len(self.ids) and (
                self._ends[self._sent_tokens] <= limit or (final and self.stop_at < 0)):
            k = self._sent_tokens
            tokens.append((self.ids[k], self._extra[k]))
            self._sent_tokens += 1
        return piece, tokens


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 1 or not logits.is_floating_point() or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty floating [V] tensor, got {logits.dtype} {list(logits.shape)}")
