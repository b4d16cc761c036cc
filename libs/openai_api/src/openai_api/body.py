"""An OpenAI request body, checked once: ``read_body`` (raw bytes -> the JSON object; strict JSON),
``validate_body`` (the JSON object -> its typed request of ``body_types``: the one validation of a
body, which the decode, the prefill in both modes and the proxy all run) and ``validated`` (any
model, its refusal turned into a ``RequestError``: the P/D wiring and the proxy's registration use
it too). Every refusal is a ``RequestError`` whose message names the field, then states the rule and
what was sent: ``"<field>: <what is wrong>"``."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from openai_api.body_types import COMBINATION, ChatCompletionRequest, CompletionRequest, OpenAIRequest, refused
from openai_api.fields import UNSUPPORTED_MESSAGE_FIELDS, WIRING

_Model = TypeVar("_Model", bound=BaseModel)
_ABSENT = object()
SHOWN_CHARS = 80  # of a refused value, in the message
_JSON_TYPES = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


class RequestError(ValueError):
    """A request body field is missing or invalid; the message names the field first:
    ``"<field>: <what is wrong>"``."""

    @property
    def field(self) -> str:
        return str(self).partition(":")[0]

    @property
    def detail(self) -> str:
        return str(self).partition(":")[2].strip()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def read_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object (strict JSON: no NaN or Infinity)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise RequestError(f"body: not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise RequestError(f"body: must be a JSON object, got {_JSON_TYPES.get(type(body), 'a number')}")
    return body


def validate_body(body: dict[str, Any], *, chat: bool, first_token_only: bool = False) -> OpenAIRequest:
    """``body`` as the endpoint's typed request, or the ``RequestError`` that refuses it. The P/D
    wiring (``fields.WIRING``) is left aside: ``transfer_params`` reads it. ``first_token_only``: the
    prefill's dispatch, which samples one token with the client's other parameters."""
    model: type[OpenAIRequest] = ChatCompletionRequest if chat else CompletionRequest
    fields = {k: v for k, v in body.items() if k not in WIRING}
    return validated(model, fields, context={"first_token_only": first_token_only})


def validated(model: type[_Model], data: Any, *, where: str = "", context: dict[str, Any] | None = None) -> _Model:
    """``data`` as ``model``, or a ``RequestError`` naming the field (``where``: the path of ``data``
    itself in the body, e.g. ``kv_transfer_params``)."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise refusal(model, data, exc.errors()[0], where) from None


def refusal(model: type[BaseModel], data: Any, err: ErrorDetails, where: str = "") -> RequestError:
    """The ``RequestError`` of pydantic's error ``err`` validating ``data`` as ``model``: the field it
    is about (a union's member or a list's item is its field's error), the field's rule (its
    ``description``; else pydantic's message) and the value sent."""
    if err["type"] == COMBINATION:
        return RequestError(err["msg"])
    path, rule, rest, reached = _locate(model, tuple(err["loc"]))
    if err["type"] == "extra_forbidden" and reached is not None and _only_indexes(rest[:-1]):
        return _unknown(where, path + rest, reached, top_level=not path)
    name = _path(where, path)
    if err["type"] == "missing":
        return RequestError(f"{name}: required" + (f" ({rule})" if rule else ""))
    value = _show(_value_at(data, path))
    if rule:
        return RequestError(f"{name}: must be {rule}, got {value}")
    return RequestError(f"{name}: {err['msg']}, got {value}")


def _unknown(where: str, path: list[str | int], model: type[BaseModel], *, top_level: bool) -> RequestError:
    key, name = str(path[-1]), _path(where, path)
    if top_level and refused(key) and hasattr(model, "path"):
        return RequestError(f"{name}: not supported by this server on {model.path}")
    if not top_level and key in UNSUPPORTED_MESSAGE_FIELDS:
        return RequestError(f"{name}: not supported by this server")
    if top_level:
        return RequestError(f"{name}: unknown parameter")
    return RequestError(f"{name}: unknown parameter ({_path(where, path[:-1])} takes {', '.join(model.model_fields)})")


def _locate(
    model: type[BaseModel], loc: tuple[str | int, ...]
) -> tuple[list[str | int], str | None, list[str | int], type[BaseModel] | None]:
    """Walk ``loc`` through the model's fields: (the path of the deepest field reached, its rule, the
    rest of ``loc``, the model whose fields come next, or None past a union or a plain value)."""
    path: list[str | int] = []
    rest, rule = list(loc), None
    current: type[BaseModel] | None = model
    while current is not None:
        k = next((i for i, part in enumerate(rest) if isinstance(part, str)), None)
        if k is None or rest[k] not in current.model_fields:
            break
        info = current.model_fields[str(rest[k])]
        path, rest = path + rest[: k + 1], rest[k + 1 :]
        rule, current = info.description, _item_model(info.annotation)
    return path, rule, rest, current


def _item_model(annotation: Any) -> type[BaseModel] | None:
    """The model a field's value (or each item of its list) is, when it is one and not a union."""
    members = [m for m in typing.get_args(annotation) if m is not type(None)] if _is_union(annotation) else [annotation]
    if len(members) != 1:
        return None
    (inner,) = members
    while typing.get_origin(inner) is typing.Annotated:
        inner = typing.get_args(inner)[0]
    if typing.get_origin(inner) is list:
        return _item_model(typing.get_args(inner)[0])
    return inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _only_indexes(parts: list[str | int]) -> bool:
    return all(isinstance(p, int) for p in parts)


def _path(where: str, parts: list[str | int]) -> str:
    out = where
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "body"


def _value_at(data: Any, path: list[str | int]) -> Any:
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return _ABSENT
    return data


def _show(value: Any) -> str:
    text = "nothing" if value is _ABSENT else repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
