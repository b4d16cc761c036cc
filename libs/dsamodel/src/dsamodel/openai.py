"""OpenAI request bodies -> prompt token ids and sampling parameters (both services use it).

``prompt`` may be a string or a list of token ids; chat ``messages`` go through the tokenizer's
chat template. Defaults follow the OpenAI API where they matter for determinism: ``max_tokens``
16, ``temperature`` 1.0, ``top_p`` 1.0; ``seed`` defaults to 0 so a request is repeatable.
"""

from __future__ import annotations

from typing import Any

from dsamodel.sampling import SamplingParams
from dsamodel.tokenizer import ByteTokenizer


class RequestError(ValueError):
    """A request body field is missing or invalid; the message names the field."""


def prompt_ids(body: dict[str, Any], tokenizer: ByteTokenizer, *, chat: bool) -> list[int]:
    """The prompt's token ids: ``messages`` for chat, else ``prompt`` (text or token ids)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise RequestError("messages: must be a non-empty list of {role: str, content: str}")
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_bos=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, add_bos=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise RequestError(f"prompt: token id {bad[0]} outside the vocabulary [0, {tokenizer.vocab_size})")
        return list(prompt)
    raise RequestError("prompt: must be a non-empty string or a non-empty list of token ids")


def sampling_params(body: dict[str, Any]) -> SamplingParams:
    """``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``, ``ignore_eos``."""
    fields = {
        "max_tokens": body.get("max_tokens", body.get("max_completion_tokens", 16)),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "seed": body.get("seed", 0) if body.get("seed") is not None else 0,
        "ignore_eos": body.get("ignore_eos", False),
    }
    if fields["max_tokens"] is None:
        fields["max_tokens"] = 16
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise RequestError(str(exc)) from exc
