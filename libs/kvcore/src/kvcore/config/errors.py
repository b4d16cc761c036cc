"""``ConfigError`` and the friendly messages of config problems.

Every problem is ``<dotted.path>: got <value> (<type>); <rule>``. The config models raise their
rules as pydantic errors carrying (relative path, text) problems (``rules_error``/``rule_error``);
``problems_of`` turns a pydantic ``ValidationError`` back into (absolute path, text) problems,
with a friendly text for pydantic's own errors too.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from kvcore.config.names import CONNECTORS, ROLES
from kvcore.pool.registry import STORE_BACKENDS

Loc = tuple[str | int, ...]
Problem = tuple[Loc, str]

_RULE = "kvoffload_rule"
_REQUIRED_RULES = {
    "kv_connector": "must be one of " + ", ".join(map(repr, CONNECTORS)),
    "kv_role": "must be one of " + ", ".join(map(repr, ROLES)),
    "backend": "must be one of " + ", ".join(map(repr, STORE_BACKENDS)),
    "connectors": "must be a non-empty list of connector configs",
}


class ConfigError(ValueError):
    """A configuration is invalid; ``errors`` lists every problem found (message = them joined by "; ")."""

    def __init__(self, errors: str | Sequence[str]) -> None:
        self.errors: list[str] = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("; ".join(self.errors))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.errors,))

    @classmethod
    def from_validation_error(cls, exc: ValidationError, root: str) -> ConfigError:
        """Friendly messages (``path: got ...; rule``) of a pydantic ValidationError."""
        return cls([f"{format_path(loc, root)}: {message}" for loc, message in problems_of(exc)])


def describe_value(value: Any) -> str:
    """``True (bool)``, ``'10GB' (str)``: the value and its Python type, for error messages."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def format_path(loc: Iterable[str | int], root: str) -> str:
    """``('a', 'connectors', 1, 'b')`` -> ``a.connectors[1].b``; the empty path -> ``root``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or root


def suggest(word: object, options: Iterable[str], cutoff: float = 0.6) -> str:
    """``"did you mean 'x'?"`` for the closest option (difflib), or ``""`` when none is close."""
    if not isinstance(word, str):
        return ""
    matches = difflib.get_close_matches(word, list(options), n=1, cutoff=cutoff)
    return f"did you mean {matches[0]!r}?" if matches else ""


def hint(word: object, options: Iterable[str], sep: str) -> str:
    """``suggest``'s text after ``sep``, or ``""`` when there is none."""
    text = suggest(word, options)
    return f"{sep}{text}" if text else ""


def rules_error(problems: Sequence[Problem]) -> PydanticCustomError:
    """A pydantic error carrying our problems (paths relative to where it is raised)."""
    message = "; ".join(f"{format_path(loc, '.')}: {text}" if loc else text for loc, text in problems)
    return PydanticCustomError(_RULE, "{message}", {"message": message, "problems": list(problems)})


def rule_error(text: str) -> PydanticCustomError:
    """A pydantic error carrying one problem of the value where it is raised."""
    return rules_error([((), text)])


def problems_of(exc: ValidationError) -> list[Problem]:
    """Every problem of a ValidationError as (absolute loc, friendly message)."""
    out: list[Problem] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == _RULE:
            out.extend((loc + tuple(rel), text) for rel, text in err["ctx"]["problems"])
        else:
            out.append((loc, _generic_message(err)))
    return out


def _generic_message(err: Mapping[str, Any]) -> str:
    kind = err["type"]
    if kind == "missing":
        rule = _REQUIRED_RULES.get(str(err["loc"][-1]) if err["loc"] else "", "")
        return "required key is missing" + (f"; {rule}" if rule else "")
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"got {describe_value(err['input'])}; must be a JSON object"
    return f"got {describe_value(err['input'])}; {err['msg']}"
