"""The typed OpenAI request bodies: ``CompletionRequest`` (POST /v1/completions) and
``ChatCompletionRequest`` (POST /v1/chat/completions). Each lists exactly the fields the engine
honours (anything else is refused: by name when ``refused``), with its type, its limits and its rule
(the field's ``description``: a refusal states it, ``/openapi.json`` shows it); each refuses the
combinations the engine cannot serve; a checked body maps to its ``SamplingParams``.

Bodies are checked through ``openai_api.body.validate_body``, the one validation of a body, which
turns a refusal into a ``RequestError`` naming the field. Types are strict: ``"stream": "yes"`` or
``"max_tokens": 1.5`` is refused, never coerced (3.0 counts as the integer 3); a JSON null means "not
given" (the defaults are the OpenAI API's where they matter for determinism: ``max_tokens`` 16,
``temperature`` 1, ``top_p`` 1; ``seed`` 0, so a request repeats).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from openai_api.fields import MAX_LOGPROBS, MAX_N, MAX_SEED, MAX_STOP, TOKEN_ID_BOUND, UNSUPPORTED
from openai_api.sampling_params import SamplingParams, choice_seed

COMBINATION = "combination_refused"  # the error type of a combination refused; its message is "<field>: <why>"
DEFAULT_MAX_TOKENS = 16


def _integral(v: Any) -> Any:
    """JSON Schema's "integer" includes 3.0; strings and booleans stay refused."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


# Field(...) before the validator, or its bounds leave the JSON schema
TokenId = Annotated[int, Field(ge=0, lt=TOKEN_ID_BOUND), BeforeValidator(_integral)]
Count = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
Choices = Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_integral)]
Seed = Annotated[int, Field(ge=0, lt=MAX_SEED), BeforeValidator(_integral)]
TopK = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_integral)]
NonNegative = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
Stop = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_STOP)]
TOKEN_IDS = f"integers in [0, 2**{TOKEN_ID_BOUND.bit_length() - 1})"


def _context(info: ValidationInfo, key: str) -> bool:
    return bool((info.context or {}).get(key))


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StreamOptions(_Strict):
    include_usage: bool | None = Field(None, description="a boolean: a last chunk carries the usage")


class _Generate(_Strict):
    """What both endpoints accept."""

    path: ClassVar[str]
    model: str | None = Field(None, description="a string")
    stream: bool | None = Field(None, description="a boolean")
    stream_options: StreamOptions | None = Field(None, description="an object {include_usage}, only with stream: true")
    max_tokens: Count | None = Field(None, description=f"an integer >= 1 (default {DEFAULT_MAX_TOKENS})")
    n: Choices | None = Field(None, description=f"an integer in [1, {MAX_N}] (default 1)")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = Field(None, description="a number in [0, 2] (default 1)")
    top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(None, description="a number in (0, 1] (default 1)")
    seed: Seed | None = Field(None, description="an integer in [0, 2**63) (default 0)")
    stop: Stop | None = Field(None, description=f"a non-empty string or a list of 1 to {MAX_STOP} non-empty strings")
    stop_token_ids: list[TokenId] | None = Field(None, description=f"a list of token ids ({TOKEN_IDS})")
    presence_penalty: Penalty | None = Field(None, description="a number in [-2, 2] (default 0)")
    frequency_penalty: Penalty | None = Field(None, description="a number in [-2, 2] (default 0)")
    min_tokens: NonNegative | None = Field(None, description="an integer >= 0, at most max_tokens (default 0)")
    ignore_eos: bool | None = Field(None, description="a boolean")
    user: str | None = Field(None, description="a string")

    @model_validator(mode="after")
    def _combinations(self, info: ValidationInfo) -> _Generate:
        problem = self.refusal(first_token_only=_context(info, "first_token_only"))
        if problem is not None:
            raise PydanticCustomError(COMBINATION, "{refusal}", {"refusal": problem})
        return self

    def refusal(self, *, first_token_only: bool) -> str | None:
        """The combination of fields this engine cannot serve, "<field>: <why>", or None.
        ``first_token_only``: the prefill's dispatch, which samples one token with the client's other
        parameters (``min_tokens`` may exceed its ``max_tokens: 1``)."""
        if self.stream_options is not None and not self.stream:
            return "stream_options: only allowed with stream: true"
        if (self.min_tokens or 0) > self.max_new_tokens and not first_token_only:
            return f"min_tokens: {self.min_tokens} exceeds max_tokens ({self.max_new_tokens})"
        return None

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def max_new_tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    @property
    def logprob_alternatives(self) -> int | None:
        """None for no log-probabilities, else how many top alternatives per token."""
        raise NotImplementedError

    def sampling_params(self, choice: int = 0) -> SamplingParams:
        """The sampling settings of choice ``choice`` (its seed derived: ``choice_seed``)."""
        return SamplingParams(
            max_tokens=self.max_new_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=choice_seed(self.seed or 0, choice),
            ignore_eos=bool(self.ignore_eos),
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            min_tokens=self.min_tokens or 0,
            logprobs=self.logprob_alternatives,
        )


class CompletionRequest(_Generate):
    """POST /v1/completions. A list of prompts is one request per prompt and choice."""

    path: ClassVar[str] = "/v1/completions"
    prompt: Prompt = Field(
        description="a non-empty string, a non-empty list of non-empty strings, a non-empty list of token ids "
        f"({TOKEN_IDS}) or a non-empty list of such token-id lists"
    )
    logprobs: TopK | None = Field(None, description=f"an integer in [0, {MAX_LOGPROBS}]: top alternatives per token")
    echo: bool | None = Field(None, description="a boolean, not with logprobs")
    best_of: Count | None = Field(None, description="an integer equal to n")

    def refusal(self, *, first_token_only: bool) -> str | None:
        if self.best_of is not None and self.best_of != self.choices:
            return f"best_of: only best_of == n is supported (got best_of={self.best_of}, n={self.choices})"
        if self.echo and self.logprobs is not None:
            return "echo: echo together with logprobs (prompt log-probabilities) is not supported"
        return super().refusal(first_token_only=first_token_only)

    @property
    def is_batch(self) -> bool:
        return isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list))

    @property
    def prompts(self) -> tuple[str | list[int], ...]:
        """Each prompt: a text or its token ids (one, unless a list of prompts)."""
        if self.is_batch:
            return tuple(cast("list[str | list[int]]", self.prompt))
        return (cast("str | list[int]", self.prompt),)

    @property
    def logprob_alternatives(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"] = Field(description='"text"')
    text: str = Field(description="a string")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"] = Field(description="system, user or assistant")
    content: str | list[TextPart] = Field(
        description='a string or a list of text parts ({"type": "text", "text": ...}); other content is not supported'
    )

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Generate):
    """POST /v1/chat/completions."""

    path: ClassVar[str] = "/v1/chat/completions"
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
        description="a non-empty list of messages {role, content}"
    )
    max_completion_tokens: Count | None = Field(None, description="an integer >= 1; wins over max_tokens")
    logprobs: bool | None = Field(None, description="a boolean")
    top_logprobs: TopK | None = Field(
        None, description=f"an integer in [0, {MAX_LOGPROBS}]: top alternatives per token, with logprobs: true"
    )

    def refusal(self, *, first_token_only: bool) -> str | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs: needs logprobs: true"
        return super().refusal(first_token_only=first_token_only)

    @property
    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or super().max_new_tokens

    @property
    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


OpenAIRequest = CompletionRequest | ChatCompletionRequest


def refused(name: str) -> bool:
    """A known parameter this server does not honour (on this endpoint, or at all): a client is told
    "not supported" rather than "unknown"."""
    return name in UNSUPPORTED or name in CompletionRequest.model_fields or name in ChatCompletionRequest.model_fields
