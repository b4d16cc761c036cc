"""An OpenAI request body, checked: ``read_body`` (raw bytes -> the JSON object), ``check_body``
(the fields an endpoint accepts, the parameters and combinations this engine cannot honour) and
the typed field readers the parameter mapping uses. Every refusal is a ``RequestError`` whose
message names the field; a JSON ``null`` counts as absent."""

from __future__ import annotations

import json
import math
from typing import Any

from openai_api.fields import CHAT_FIELDS, COMPLETION_FIELDS, MAX_N, refused


class RequestError(ValueError):
    """A request body field is missing or invalid; the message names the field first:
    ``"<field>: <what is wrong>"``."""

    @property
    def field(self) -> str:
        return str(self).partition(":")[0]

    @property
    def detail(self) -> str:
        return str(self).partition(":")[2].strip()


def read_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError("body: malformed JSON") from None
    if not isinstance(body, dict):
        raise RequestError("body: must be a JSON object")
    return body


def present(body: dict[str, Any], key: str) -> bool:
    return body.get(key) is not None


def int_field(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    """``body[key]`` as an integer in [lo, hi] (3.0 counts as 3), None when absent."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise RequestError(f"{key}: must be an integer {bound}, got {body.get(key)!r}")
    return v


def number_field(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    """``body[key]`` as a finite number in [lo, hi], None when absent."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise RequestError(f"{key}: must be a number in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def bool_field(body: dict[str, Any], key: str) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise RequestError(f"{key}: must be a boolean, got {v!r}")
    return v


def check_body(body: dict[str, Any], *, chat: bool, max_n: int | None = 1) -> None:
    """Refuse what this engine cannot honour; the message names the field. ``max_n``: the largest
    ``n`` this service serves (the decode serves one choice per request; the proxy splits ``n``)."""
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key in body:
        if key in allowed:
            continue
        if refused(key):
            raise RequestError(
                f"{key}: not supported by this server{' on /v1/chat/completions' if chat else ' on /v1/completions'}"
            )
        raise RequestError(f"{key}: unknown parameter")
    for key in ("stream", "ignore_eos") + (() if chat else ("echo",)):
        bool_field(body, key)
    _check_stream_options(body)
    n = int_field(body, "n", 1, MAX_N) or 1
    if max_n is not None and n > max_n:
        raise RequestError(
            f"n: this service returns at most {max_n} choice(s) per request; send n > 1 through the proxy"
        )
    if not chat:
        best_of = int_field(body, "best_of", 1)
        if best_of is not None and best_of != n:
            raise RequestError(f"best_of: only best_of == n is supported (got best_of={best_of}, n={n})")
        if body.get("echo") and present(body, "logprobs"):
            raise RequestError("echo: echo together with logprobs (prompt log-probabilities) is not supported")
    if present(body, "model") and not isinstance(body["model"], str):
        raise RequestError("model: must be a string")
    if present(body, "user") and not isinstance(body["user"], str):
        raise RequestError("user: must be a string")


def _check_stream_options(body: dict[str, Any]) -> None:
    if not present(body, "stream_options"):
        return
    opts = body["stream_options"]
    if not isinstance(opts, dict):
        raise RequestError("stream_options: must be an object")
    if not body.get("stream"):
        raise RequestError("stream_options: only allowed with stream: true")
    for key in opts:
        if key != "include_usage":
            raise RequestError(f"stream_options.{key}: unknown option (only include_usage)")
    if opts.get("include_usage") is not None and not isinstance(opts["include_usage"], bool):
        raise RequestError("stream_options.include_usage: must be a boolean")
