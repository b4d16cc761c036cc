"""OpenAI request bodies -> the request an engine runs: prompt token ids, ``SamplingParams`` and the
``kv_transfer_params``. ``parse_request`` reads a single-prompt request (the decode and the
offload-only prefill); ``dispatch.parse_dispatch`` reads the proxy's prefill dispatch. Both check the
body with ``body.validate_body`` (the one validation of a body) and add only what needs this service:
the tokenizer's vocabulary, ``max_model_len``, one prompt and one choice here.

``prompt`` may be a string or a list of token ids; chat ``messages`` go through the tokenizer's
chat template.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from openai_api.body import RequestError, read_body, validate_body
from openai_api.body_types import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from openai_api.sampling_params import SamplingParams
from openai_api.tokenizer import Tokenizer
from openai_api.transfer_params import KVTransferParams, parse_transfer_params


@dataclass(frozen=True)
class ParsedRequest:
    """A checked single-prompt request: its body (as sent) and typed request, prompt ids, sampling
    parameters and P/D wiring."""

    body: dict[str, Any]
    request: OpenAIRequest
    prompt_ids: list[int]
    params: SamplingParams
    transfer: KVTransferParams | None

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)

    @property
    def include_usage(self) -> bool:
        return self.request.include_usage


def parse_request(
    raw: bytes,
    tokenizer: Tokenizer,
    *,
    chat: bool,
    max_model_len: int,
    refuse: Callable[[dict[str, Any]], None] | None = None,
) -> ParsedRequest:
    """The request in ``raw`` (one prompt, one choice), or a RequestError naming the field.
    ``refuse(body)``: the serving mode's own refusals, checked before the body's."""
    body = read_body(raw)
    if refuse is not None:
        refuse(body)
    request = validate_body(body, chat=chat)
    if request.choices > 1:
        raise RequestError(
            f"n: this service returns one choice per request (got n={request.choices}); send n > 1 through the proxy"
        )
    if isinstance(request, CompletionRequest) and request.is_batch:
        raise RequestError(
            "prompt: this service takes one prompt per request; send a list of prompts through the proxy"
        )
    (ids,) = prompt_ids(request, tokenizer)
    params = request.sampling_params()
    if len(ids) + params.max_tokens > max_model_len:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len={max_model_len}"
        )
    return ParsedRequest(body, request, ids, params, parse_transfer_params(body.get("kv_transfer_params")))


def prompt_ids(request: OpenAIRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """Each prompt's token ids: the chat template over ``messages`` (one prompt), else each prompt of
    ``prompt`` (a text, or token ids inside the vocabulary)."""
    if isinstance(request, ChatCompletionRequest):
        plain = [{"role": m.role, "content": m.text} for m in request.messages]
        return [tokenizer.encode(tokenizer.apply_chat_template(plain), add_bos=False)]
    return [_ids(prompt, tokenizer) for prompt in request.prompts]


def _ids(prompt: str | list[int], tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_bos=True)
    bad = [t for t in prompt if t >= tokenizer.vocab_size]
    if bad:
        raise RequestError(f"prompt: token id {bad[0]} outside the vocabulary [0, {tokenizer.vocab_size})")
    return list(prompt)
