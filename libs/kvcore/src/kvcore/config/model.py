"""``ConfigModel``: the base of every config model (frozen, strict, every problem in one pass).

Field errors and cross-field problems (``_raw_problems``, seen on the raw input) are raised
together. Unknown keys are not errors: they become warnings (with a "did you mean" suggestion)
kept on the parsed object, with the model's own warnings (``_own_warnings``) and those of nested
models (``_children``); ``warnings`` lists them all with their dotted paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, model_validator

from kvcore.config.errors import Loc, Problem, format_path, hint, problems_of, rules_error


class ConfigModel(BaseModel):
    """Frozen, strict model; unknown keys become warnings, cross-field problems join field ones."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    _ROOT: ClassVar[str] = "config"
    _SILENT_KEYS: ClassVar[frozenset[str]] = frozenset()
    _warning_items: list[Problem] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _validate_all(cls, data: Any, handler: Callable[[Any], Any]) -> Any:
        if not isinstance(data, dict):
            return handler(data)
        problems = cls._raw_problems(data)
        try:
            model = handler(data)
        except ValidationError as exc:
            raise rules_error(problems_of(exc) + problems) from None
        if problems:
            raise rules_error(problems)
        model._warning_items = [((), text) for text in cls._unknown_key_warnings(data)] + model._own_warnings()
        return model

    @classmethod
    def _raw_problems(cls, data: dict[str, Any]) -> list[Problem]:
        """Cross-field problems visible on the raw input (reported with the field errors)."""
        return []

    @classmethod
    def _unknown_key_warnings(cls, data: Mapping[Any, Any]) -> list[str]:
        known = list(cls.model_fields)
        accepted = set(known) | cls._SILENT_KEYS
        return [
            f"unknown key {key!r} (ignored);{hint(key, sorted(accepted), ' ')} known keys: {', '.join(known)}"
            for key in data
            if key not in accepted
        ]

    def _own_warnings(self) -> list[Problem]:
        return []

    def _children(self) -> Iterable[tuple[Loc, ConfigModel]]:
        return ()

    def warning_items(self) -> list[Problem]:
        """Warnings of this object and every nested one, as (loc relative to this object, text)."""
        items = list(self._warning_items)
        for loc, child in self._children():
            items.extend((loc + rel, text) for rel, text in child.warning_items())
        return items

    @property
    def warnings(self) -> list[str]:
        """Warnings of this object and nested ones, each prefixed with its dotted path."""
        return [f"{format_path(loc, self._ROOT)}: {text}" for loc, text in self.warning_items()]
