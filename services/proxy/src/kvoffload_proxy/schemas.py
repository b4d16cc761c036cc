"""Request bodies the proxy accepts, validated once at the edge (also the OpenAPI schemas).

The inference bodies list exactly the OpenAI parameters the engine honours (`extra="forbid"`;
`openai_api.fields` is the list, and the limits): an unknown field, or a known one the engine
cannot honour (`tools`, `response_format`, `logit_bias`, ...), is a 400 naming it, as are
combinations it cannot serve (`best_of` != `n`, `echo` with `logprobs`, `top_logprobs` without
`logprobs`, `stream_options` without `stream`, `min_tokens` > `max_tokens`: `openai_api`'s own
checks, which the decode and prefill run too). Types are strict: `"stream": "yes"` or
`"max_tokens": 1.5` is a 400 naming the field, not a silent coercion. A JSON `null` means "not given".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from openai_api.body import RequestError, check_body
from openai_api.fields import MAX_LOGPROBS, MAX_N, MAX_SEED, MAX_STOP, UNSUPPORTED_MESSAGE_FIELDS, refused
from openai_api.request import sampling_params
from openai_api.transfer_params import KVTransferParams

from .errors import ProxyError


def _integral(v: Any) -> Any:
    """JSON Schema's "integer" includes 3.0; strings and booleans stay rejected."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


TokenId = Annotated[int, Field(ge=0, lt=2**31), BeforeValidator(_integral)]
PositiveInt = Annotated[
    int, Field(ge=1), BeforeValidator(_integral)
]  # Field first, or its bounds leave the JSON schema
Prompt = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)
Stop = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_STOP)]
)
_UNION_HELP = {
    "prompt": "must be a string, a non-empty list of strings, a non-empty list of token ids "
    "(integers >= 0) or a non-empty list of such token-id lists",
    "content": 'must be a string or a list of text parts ({"type": "text", "text": ...})',
    "stop": f"must be a non-empty string or a list of 1 to {MAX_STOP} non-empty strings",
}
CHARS_PER_TOKEN = 4  # the proxy does not tokenize; loads are estimates
InferenceKind = Literal["completions", "chat"]
_Model = TypeVar("_Model", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Generate(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_integral)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, lt=MAX_SEED), BeforeValidator(_integral)] | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    min_tokens: Annotated[int, Field(ge=0), BeforeValidator(_integral)] | None = None
    ignore_eos: bool | None = None
    user: str | None = None


class CompletionRequest(_Generate):
    """POST /v1/completions. A list of prompts becomes one child request per prompt and choice."""

    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_integral)] | None = None
    echo: bool | None = None
    best_of: PositiveInt | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]


class ChatCompletionRequest(_Generate):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_integral)] | None = None


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


def validate(model: type[_Model], data: dict[str, Any]) -> _Model:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        path, union_field = _field_path(tuple(err["loc"]))
        if err["type"] == "missing":
            msg = f"field '{path}' is required"
        elif err["type"] == "extra_forbidden":
            name = path.rsplit(".", 1)[-1]
            msg = (
                f"field '{path}' is not supported by this server"
                if refused(name) or name in UNSUPPORTED_MESSAGE_FIELDS
                else f"field '{path}' is not a recognized parameter"
            )
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
        else:
            chars += sum(len(p.text) for p in m.content)
    return max(1, math.ceil(chars / CHARS_PER_TOKEN) + 4 * len(messages))


def parse_inference(kind: InferenceKind, raw: bytes) -> InferenceRequest:
    data = load_json_object(raw)
    req: CompletionRequest | ChatCompletionRequest
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
    _check_combinations(data, chat=kind == "chat")
    n = req.n
    return InferenceRequest(
        kind=kind,
        body=data,
        prompts=tuple(p for p in prompts for _ in range(n)),
        is_batch=is_batch,
        stream=req.stream,
        n=n,
        num_prompt_tokens=tuple(t for t in tokens for _ in range(n)),
        max_tokens=max_tokens,
    )


def _check_combinations(data: dict[str, Any], *, chat: bool) -> None:
    """What the field types cannot say: combinations the engine cannot serve (openai_api's checks;
    `n` is split into children here, so any `n` the schema allows)."""
    try:
        check_body(data, chat=chat, max_n=None)
        sampling_params(data, chat=chat)
    except RequestError as e:
        raise ProxyError(400, f"field '{e.field}': {e.detail}", param=e.field) from None
