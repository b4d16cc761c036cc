"""What the proxy reads of the requests it accepts. An inference body is checked by
``openai_api.body.validate_body``, the one validation of an OpenAI body (the decode and the prefill
run the same; its models, ``openai_api.body_types``, are also the OpenAPI schemas): an unknown
field, one the engine cannot honour, a wrong type or a combination it cannot serve is a 400 naming
the field. What stays here is the proxy's own: the children of a request (one per prompt and
choice), its load estimate, and the decoders' ``/v1/metaserver`` registration.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from openai_api.body import RequestError, read_body, validate_body, validated
from openai_api.body_types import ChatMessage, CompletionRequest
from openai_api.fields import WIRING
from openai_api.transfer_params import KVTransferParams

from .errors import ProxyError

CHARS_PER_TOKEN = 4  # the proxy does not tokenize; loads are estimates
InferenceKind = Literal["completions", "chat"]
_Model = TypeVar("_Model", bound=BaseModel)


class MetaserverRegistration(BaseModel):
    """POST /v1/metaserver, sent by a decoder once it holds host memory for `request_id`.

    `kv_transfer_params` are the decoder's endpoint parameters (host, control ports, dp/tp, ...),
    checked (`openai_api.transfer_params`) and handed verbatim to the prefiller. A body without that
    key is taken as the params themselves (the form the reference decoders send).
    """

    model_config = ConfigDict(strict=True, extra="allow")

    request_id: Annotated[str, Field(min_length=1, max_length=256)]
    kv_transfer_params: KVTransferParams | None = None


@dataclass(frozen=True)
class InferenceRequest:
    """A validated client request. `prompts` and `num_prompt_tokens` have one entry per child:
    child `i * n + j` is choice j of prompt i (prompt None for chat)."""

    kind: InferenceKind
    body: dict[str, Any]
    prompts: tuple[Any, ...]
    is_batch: bool
    stream: bool
    n: int
    num_prompt_tokens: tuple[int, ...]
    max_tokens: int

    @property
    def path(self) -> str:
        return "/v1/completions" if self.kind == "completions" else "/v1/chat/completions"

    @property
    def num_children(self) -> int:
        return len(self.prompts)


@contextmanager
def _bad_request() -> Iterator[None]:
    """A ``RequestError`` as the proxy's 400: the message as openai_api words it, the field as ``param``."""
    try:
        yield
    except RequestError as e:
        raise ProxyError(400, str(e), param=None if e.field == "body" else e.field) from None


def load_json_object(raw: bytes) -> dict[str, Any]:
    """Strict JSON (no NaN/Infinity), top-level object; else a 400 saying what is wrong."""
    with _bad_request():
        return read_body(raw)


def validate(model: type[_Model], data: dict[str, Any]) -> _Model:
    """``data`` as ``model``, or a 400 naming the field (openai_api's words)."""
    with _bad_request():
        return validated(model, data)


def estimate_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return max(1, math.ceil(len(prompt) / CHARS_PER_TOKEN))
    return max(1, len(prompt))  # token ids


def _chat_tokens(messages: list[ChatMessage]) -> int:
    chars = sum(len(m.text) for m in messages)
    return max(1, math.ceil(chars / CHARS_PER_TOKEN) + 4 * len(messages))


def parse_inference(kind: InferenceKind, raw: bytes) -> InferenceRequest:
    """The client's request: checked by openai_api's one validation, then cut into children."""
    with _bad_request():
        data = read_body(raw)
        for key in WIRING:  # set by the proxy, never by clients
            data.pop(key, None)
        req = validate_body(data, chat=kind == "chat")
    prompts: tuple[str | list[int] | None, ...]
    if isinstance(req, CompletionRequest):
        is_batch, prompts = req.is_batch, req.prompts
        tokens = tuple(estimate_tokens(x) for x in req.prompts)
    else:
        is_batch, prompts, tokens = False, (None,), (_chat_tokens(req.messages),)
    n = req.choices
    return InferenceRequest(
        kind=kind,
        body=data,
        prompts=tuple(p for p in prompts for _ in range(n)),
        is_batch=is_batch,
        stream=bool(req.stream),
        n=n,
        num_prompt_tokens=tuple(t for t in tokens for _ in range(n)),
        max_tokens=req.max_new_tokens,
    )
