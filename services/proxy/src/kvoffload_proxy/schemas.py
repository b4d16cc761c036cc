"""Request bodies the proxy accepts, validated once at the edge (also the OpenAPI schemas).

Only the fields the proxy itself acts on are typed; everything else is passed through to the
backends untouched (`extra="allow"`). Types are strict: `"stream": "yes"` or `"max_tokens": 1.5`
is a 400 naming the field, not a silent coercion.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from .errors import ProxyError



def _integral(v: Any) -> Any:
    """JSON Schema's "integer" includes 3.0; strings and booleans stay rejected."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


TokenId = Annotated[int, Field(ge=0, lt=2**31), BeforeValidator(_integral)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral)]  # Field first, or its bounds leave the JSON schema
Prompt = (str | Annotated[list[str], Field(min_length=1)]
          | Annotated[list[TokenId], Field(min_length=1)]
          | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
_UNION_HELP = {
    "prompt": "must be a string, a non-empty list of strings, a non-empty list of token ids "
              "(integers >= 0) or a non-empty list of such token-id lists",
    "content": "must be a string, a list of content-part objects, or null",
}
CHARS_PER_TOKEN = 4  # the proxy does not tokenize; loads are estimates


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Generate(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: PositiveInt | None = None
    n: PositiveInt = 1


class CompletionRequest(_Generate):
    """POST /v1/completions. A list of prompts becomes one child request per prompt."""

    prompt: Prompt


class ChatMessage(_Strict):
    role: Annotated[str, Field(min_length=1)]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Generate):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None


class MetaserverRegistration(_Strict):
    """POST /v1/metaserver, sent by a decoder once it holds host memory for `request_id`.

    `kv_transfer_params` are the decoder's endpoint parameters (host, control ports, dp/tp, ...),
    handed verbatim to the prefiller. A body without that key is taken as the params themselves
    (the form the reference decoders send).
    """

    request_id: Annotated[str, Field(min_length=1, max_length=256)]
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(frozen=True)
class InferenceRequest:
    """A validated client request. `prompts` has one entry per child (None for chat)."""

    kind: Literal["completions", "chat"]
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


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_json_object(raw: bytes) -> dict[str, Any]:
    """Strict JSON (no NaN/Infinity), top-level object; else a 400 saying what is wrong."""
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise ProxyError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ProxyError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


def _field_path(loc: tuple[Any, ...]) -> tuple[str, str | None]:
    """('messages', 0, 'content', 'str') -> ('messages[0].content', 'content')."""
    path, union_field = "", None
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _UNION_HELP and union_field is None:
            path, union_field = (f"{path}.{part}" if path else part), part
        elif union_field is not None:
            break  # a union member's tag or its inner position
        else:
            path = f"{path}.{part}" if path else str(part)
    return path, union_field


def validate(model: type[BaseModel], data: dict[str, Any]) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        path, union_field = _field_path(tuple(err["loc"]))
        if err["type"] == "missing":
            msg = f"field '{path}' is required"
        elif union_field:
            msg = f"field '{path}' {_UNION_HELP[union_field]}"
        else:
            msg = f"field '{path}': {err['msg']}"
        raise ProxyError(400, msg, param=path or None) from None


def estimate_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return max(1, math.ceil(len(prompt) / CHARS_PER_TOKEN))
    return max(1, len(prompt))  # token ids


def _chat_tokens(messages: list[ChatMessage]) -> int:
    chars = 0
    for m in messages:
        if isinstance(m.content, str):
            chars += len(m.content)
        elif m.content:
            chars += sum(len(p["text"]) for p in m.content if isinstance(p.get("text"), str))
    return max(1, math.ceil(chars / CHARS_PER_TOKEN) + 4 * len(messages))


def parse_inference(kind: Literal["completions", "chat"], raw: bytes) -> InferenceRequest:
    data = load_json_object(raw)
    data.pop("kv_transfer_params", None)  # set by the proxy, never by clients
    data.pop("kv_transfer_params_list", None)
    if kind == "completions":
        req = validate(CompletionRequest, data)
        p = req.prompt
        is_batch = isinstance(p, list) and isinstance(p[0], (str, list))
        prompts = tuple(p) if is_batch else (p,)
        tokens = tuple(estimate_tokens(x) for x in prompts)
    else:
        req = validate(ChatCompletionRequest, data)
        is_batch, prompts, tokens = False, (None,), (_chat_tokens(req.messages),)
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or 16
    return InferenceRequest(kind=kind, body=data, prompts=prompts, is_batch=is_batch,
                            stream=req.stream, n=req.n, num_prompt_tokens=tokens,
                            max_tokens=max_tokens)
