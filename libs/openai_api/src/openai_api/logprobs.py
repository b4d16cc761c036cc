"""The OpenAI shapes of log-probabilities and finish reasons: ``TokenLogprob`` (one sampled token's
log-probability and its top alternatives, as the sampler reports it) -> the ``logprobs`` object of
a completion or chat choice."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openai_api.tokenizer import Tokenizer


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the ``k`` most likely tokens (ids, log-probs), best
    first, all from ``log_softmax`` of the model's raw logits."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def finish_reason(reason: str | None) -> str | None:
    """The sampler's reason in OpenAI terms: EOS and stop strings/ids are both ``"stop"``."""
    return "stop" if reason == "eos" else reason


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """One token as OpenAI shows it in logprobs: its text, ``bytes:\\xNN`` for a byte that is not
    text on its own, a special token's name."""
    if token < 256:
        try:
            return bytes([token]).decode("utf-8")
        except UnicodeDecodeError:
            return f"bytes:\\x{token:02x}"
    return tokenizer.decode([token])


def _token_bytes(tokenizer: Tokenizer, token: int) -> list[int]:
    return [token] if token < 256 else list(tokenizer.decode([token]).encode("utf-8"))


def completion_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob], offsets: list[int]) -> dict[str, Any]:
    """``/v1/completions`` ``choices[].logprobs`` for ``TokenLogprob`` entries: ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (the top k and the chosen token) and ``text_offset``."""
    top = []
    for e in entries:
        alts = {token_text(tokenizer, t): lp for t, lp in e.top}
        alts.setdefault(token_text(tokenizer, e.token), e.logprob)
        top.append(alts)
    return {
        "tokens": [token_text(tokenizer, e.token) for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top,
        "text_offset": list(offsets),
    }


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprob]) -> dict[str, Any]:
    """``/v1/chat/completions`` ``choices[].logprobs``: ``{"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}``."""

    def one(t: int, lp: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, t), "logprob": lp, "bytes": _token_bytes(tokenizer, t)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]}
