"""OpenAI request bodies -> the request an engine runs: prompt token ids, ``SamplingParams`` and the
``kv_transfer_params``. ``parse_request`` is the one parse of a single-prompt request (the decode
and the offload-only prefill); ``dispatch.parse_dispatch`` builds on it for the proxy's prefill
dispatch.

``prompt`` may be a string or a list of token ids; chat ``messages`` go through the tokenizer's
chat template. Defaults follow the OpenAI API where they matter for determinism: ``max_tokens``
16, ``temperature`` 1.0, ``top_p`` 1.0; ``seed`` defaults to 0 so a request is repeatable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openai_api.body import RequestError, bool_field, check_body, int_field, number_field, read_body
from openai_api.fields import MAX_LOGPROBS, MAX_SEED, MAX_STOP, MESSAGE_FIELDS
from openai_api.sampling_params import SamplingParams, choice_seed
from openai_api.tokenizer import Tokenizer
from openai_api.transfer_params import KVTransferParams, parse_transfer_params


@dataclass(frozen=True)
class ParsedRequest:
    """A checked single-prompt request: its body, prompt ids, sampling parameters and P/D wiring."""

    body: dict[str, Any]
    prompt_ids: list[int]
    params: SamplingParams
    transfer: KVTransferParams | None

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))


def parse_request(
    raw: bytes,
    tokenizer: Tokenizer,
    *,
    chat: bool,
    max_model_len: int,
    refuse: Callable[[dict[str, Any]], None] | None = None,
) -> ParsedRequest:
    """The request in ``raw`` (one prompt, one choice), or a RequestError naming the field.
    ``refuse(body)``: the serving mode's own refusals, checked before the common ones."""
    body = read_body(raw)
    if refuse is not None:
        refuse(body)
    check_body(body, chat=chat)
    ids = prompt_ids(body, tokenizer, chat=chat)
    params = sampling_params(body, chat=chat)
    if len(ids) + params.max_tokens > max_model_len:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len={max_model_len}"
        )
    return ParsedRequest(body, ids, params, parse_transfer_params(body.get("kv_transfer_params")))


def stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop: must be a non-empty string or a list of at most {MAX_STOP} non-empty strings")
    return tuple(stops)


def _logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    if not chat:
        return int_field(body, "logprobs", 0, MAX_LOGPROBS)
    want = bool_field(body, "logprobs")
    top = int_field(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise RequestError("top_logprobs: needs logprobs: true")
    return (top or 0) if want else None


def prompt_ids(body: dict[str, Any], tokenizer: Tokenizer, *, chat: bool) -> list[int]:
    """The prompt's token ids: ``messages`` for chat, else ``prompt`` (text or token ids)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages: must be a non-empty list of {role, content}")
        plain = []
        for k, m in enumerate(messages):
            if not isinstance(m, dict):
                raise RequestError(f"messages[{k}]: must be an object {{role, content}}")
            extra = sorted(set(m) - MESSAGE_FIELDS)
            if extra:
                raise RequestError(f"messages[{k}].{extra[0]}: not supported by this server")
            if m.get("role") not in ("system", "user", "assistant"):
                raise RequestError(f"messages[{k}].role: must be system, user or assistant, got {m.get('role')!r}")
            plain.append({"role": m["role"], "content": _content(m.get("content"), k)})
        return tokenizer.encode(tokenizer.apply_chat_template(plain), add_bos=False)
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt, add_bos=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise RequestError(f"prompt: token id {bad[0]} outside the vocabulary [0, {tokenizer.vocab_size})")
        return list(prompt)
    raise RequestError("prompt: must be a non-empty string or a non-empty list of token ids")


def _content(content: Any, k: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict)
        and p.get("type") == "text"
        and isinstance(p.get("text"), str)
        and set(p) <= {"type", "text"}
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise RequestError(
        f"messages[{k}].content: must be a string or a list of text parts "
        "({type: text, text: str}); other content is not supported"
    )


def sampling_params(
    body: dict[str, Any], *, chat: bool = False, choice: int = 0, first_token_only: bool = False
) -> SamplingParams:
    """``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed`` (derived
    per ``choice``), ``ignore_eos``, ``stop``, ``stop_token_ids``, the penalties, ``min_tokens``,
    ``logprobs``. ``first_token_only``: the prefill, which samples one token with the client's
    other parameters (``min_tokens`` may exceed its ``max_tokens: 1``)."""
    max_tokens = int_field(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", 1)
    max_tokens = 16 if max_tokens is None else max_tokens
    min_tokens = int_field(body, "min_tokens", 0) or 0
    if min_tokens > max_tokens and not first_token_only:
        raise RequestError(f"min_tokens: {min_tokens} exceeds max_tokens ({max_tokens})")
    seed = int_field(body, "seed", 0, MAX_SEED - 1) or 0
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (
        not isinstance(stop_ids, list)
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids)
    ):
        raise RequestError("stop_token_ids: must be a list of token ids (integers >= 0)")
    temperature = number_field(body, "temperature", 0.0, 2.0)
    top_p = body.get("top_p")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not math.isfinite(top_p) or not 0 < top_p <= 1
    ):
        raise RequestError(f"top_p: must be a number in (0, 1], got {top_p!r}")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else float(top_p),
            seed=choice_seed(seed, choice),
            ignore_eos=bool(bool_field(body, "ignore_eos")),
            stop=stop_strings(body),
            stop_token_ids=tuple(stop_ids or ()),
            presence_penalty=number_field(body, "presence_penalty", -2.0, 2.0) or 0.0,
            frequency_penalty=number_field(body, "frequency_penalty", -2.0, 2.0) or 0.0,
            min_tokens=min_tokens,
            logprobs=_logprobs(body, chat=chat),
        )
    except (TypeError, ValueError) as exc:
        raise RequestError(str(exc)) from exc
