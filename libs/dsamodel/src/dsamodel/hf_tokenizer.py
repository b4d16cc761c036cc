"""``HFTokenizer``: an HF model directory's ``tokenizer.json`` and chat template, without transformers.

Implements ``openai_api.Tokenizer`` over the ``tokenizers`` library (the services must not import
transformers): ``encode`` never adds the tokenizer's own special tokens (``add_bos`` prepends
``bos_token_id``), special-token strings in the text become their ids, as transformers encodes a
rendered chat; ``decode`` is ``tokenizers``' (byte-level merges undone, specials kept or skipped).
The chat template (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``) is
rendered with jinja2 as transformers renders it: a sandboxed environment with ``trim_blocks``,
``lstrip_blocks``, the loop-controls extension, ``raise_exception`` and a ``tojson`` filter, given
``messages``, ``add_generation_prompt`` and the ``bos_token`` / ``eos_token`` strings.
BOS / EOS / pad ids: ``generation_config.json``, else ``config.json``, else ``tokenizer_config.json``'s
token strings (pad: else EOS).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"


class HFTokenizer:
    """Text <-> ids and the chat template of one HF model directory (module doc)."""

    def __init__(
        self,
        backend: _Backend,
        chat_template: str | None,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
    ) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        ids = (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id))
        for name, value in ids:
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} {value} is outside the tokenizer's [0, {self.vocab_size})")
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
        self._template = _compile(chat_template) if chat_template is not None else None
        self._chat_template = chat_template

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> HFTokenizer:
        """Load ``tokenizer.json``, the chat template and the BOS / EOS ids of model_dir."""
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"no {TOKENIZER_FILE} in {model_dir}")
        backend = _Backend.from_file(str(path))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        template_path = model_dir / TEMPLATE_FILE
        template = template_path.read_text() if template_path.is_file() else tok_config.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{model_dir}: chat_template must be one template string, got {type(template).__name__}")
        ids = {key: _special_id(model_dir, backend, tok_config, key) for key in ("bos", "eos", "pad")}
        return cls(backend, template, bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"])

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """text -> ids; special-token strings in the text become their ids."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("add_bos: this tokenizer has no bos_token_id")
            return [self.bos_token_id, *ids]
        return list(ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """ids -> text."""
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i!r} is outside [0, {self.vocab_size})")
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """[{"role", "content"}, ...] -> the prompt string (encode it to get ids)."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template (no chat_template.jinja or tokenizer_config entry)")
        for k, msg in enumerate(messages):
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
                raise ValueError(f"message {k} must be {{'role': str, 'content': str}}, got {msg!r}")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token(self.bos_token_id),
            eos_token=self._token(self.eos_token_id),
        )

    def _token(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._backend.id_to_token(token_id) or "")


def _compile(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _special_id(model_dir: Path, backend: _Backend, tok_config: dict[str, Any], kind: str) -> int | None:
    """``{kind}_token_id`` of generation_config.json, else config.json, else the tokenizer's token string."""
    key = f"{kind}_token_id"
    for name in ("generation_config.json", "config.json"):
        value = _read_json(model_dir / name).get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{model_dir / name}: {key} must be an int, got {value!r}")
            return value
    token = tok_config.get(f"{kind}_token")
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None
