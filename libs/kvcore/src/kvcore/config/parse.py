"""Parsing of the JSON users write: ``--kv-transfer-config`` and ``--additional-config``.

The formats are the ones of vllm-ascend's "Layerwise and Sparse KV Cache Offload" guide, accepted
as written (Ascend backend names included; whether a backend can run here is ``kvcore.backends``'
job, model-dependent rules are the node settings' (``kvcore.config.prefill_settings``,
``kvcore.config.decode_settings``)). ``parse_kv_transfer_config`` and ``parse_additional_config`` are the
entry points; they return frozen, strictly typed pydantic models (``kvcore.config.kv_transfer``,
``kvcore.config.connectors``, ``kvcore.config.additional``). Every problem found in one pass is
raised together as a ``ConfigError`` (``kvcore.config.errors``) whose messages name the field by
dotted path, the offending value and the rule. Unknown keys are not errors: they become warnings
(with a "did you mean" suggestion) kept on the parsed object and logged once.
"""

from __future__ import annotations

import json
from typing import Any

import structlog
from pydantic import ValidationError

from kvcore.config.additional import AdditionalConfig
from kvcore.config.errors import ConfigError, describe_value, format_path
from kvcore.config.kv_transfer import KVTransferConfig
from kvcore.config.model import ConfigModel

_log = structlog.get_logger(__name__)


def _load_json(value: Any, option: str) -> Any:
    if isinstance(value, (dict, list)):
        return value
    if not isinstance(value, str):
        raise ConfigError([f"{option}: got {describe_value(value)}; must be a JSON string or a dict"])
    try:
        return json.loads(value, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [f"{option}: malformed JSON at line {exc.lineno} column {exc.colno} (char {exc.pos}): {exc.msg}"]
        ) from None
    except _DuplicateKey as exc:
        raise ConfigError(
            [f"{option}: key {exc.args[0]!r} appears twice in one JSON object; give each key once"]
        ) from None


class _DuplicateKey(ValueError):
    """A JSON object names a key twice (json.loads would silently keep the last value)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _validate(model_cls: type[ConfigModel], data: Any, option: str) -> Any:
    try:
        model = model_cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError.from_validation_error(exc, model_cls._ROOT) from None
    _log_warnings(model, option)
    return model


def _log_warnings(model: ConfigModel, option: str) -> None:
    items = model.warning_items()
    unknown = [f"{format_path(loc, model._ROOT)}: {text}" for loc, text in items if text.startswith("unknown key ")]
    other = [f"{format_path(loc, model._ROOT)}: {text}" for loc, text in items if not text.startswith("unknown key ")]
    if unknown:
        _log.warning("unknown_config_keys", option=option, warnings=unknown)
    if other:
        _log.warning("ineffective_config_keys", option=option, warnings=other)


def parse_kv_transfer_config(value: str | dict[str, Any], *, strict: bool = False) -> KVTransferConfig:
    """Parse ``--kv-transfer-config`` (JSON string or dict); ConfigError lists every problem.

    Unknown keys are logged warnings, or with ``strict`` (our vLLM connectors: nothing else reads
    their extra config) problems of the ConfigError."""
    data = _load_json(value, "--kv-transfer-config")
    model = _validate(KVTransferConfig, data, "--kv-transfer-config")
    unknown = [
        w
        for loc, text in model.warning_items()
        if text.startswith("unknown key ")
        for w in [f"{format_path(loc, model._ROOT)}: {text.replace(' (ignored)', '')}"]
    ]
    if strict and unknown:
        raise ConfigError(unknown)
    return model


def parse_additional_config(value: str | dict[str, Any] | None) -> AdditionalConfig:
    """Parse ``--additional-config`` (JSON string, dict, or None/empty for defaults)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        value = {}
    data = _load_json(value, "--additional-config")
    return _validate(AdditionalConfig, data, "--additional-config")
