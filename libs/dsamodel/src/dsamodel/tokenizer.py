"""A byte-level tokenizer that needs no download: ids 0..255 are UTF-8 bytes, then specials.

Specials (ids 256..263): ``<|bos|>``, ``<|eos|>`` (also ends a chat turn), ``<|pad|>``,
``<|system|>``, ``<|user|>``, ``<|assistant|>``, two reserved. Their text forms in a string are
encoded as the special ids. Chat template::

    <|bos|><|system|>...<|eos|><|user|>...<|eos|><|assistant|>
"""

from __future__ import annotations

import json
import re
from pathlib import Path

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
)
NUM_BYTES = 256
CHAT_ROLES = ("system", "user", "assistant")
TOKENIZER_CLASS = "dsamodel.ByteTokenizer"


class ByteTokenizer:
    """encode/decode between text and ids; ``vocab_size`` = 256 bytes + 8 specials = 264."""

    def __init__(self) -> None:
        self.special_ids = {tok: NUM_BYTES + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._special_re = re.compile("|".join(re.escape(tok) for tok in SPECIAL_TOKENS))

    vocab_size = NUM_BYTES + len(SPECIAL_TOKENS)
    bos_token_id = NUM_BYTES
    eos_token_id = NUM_BYTES + 1
    pad_token_id = NUM_BYTES + 2

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """text -> ids; special-token strings in the text become their ids."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        ids = [self.bos_token_id] if add_bos else []
        pos = 0
        for match in self._special_re.finditer(text):
            ids.extend(text[pos : match.start()].encode("utf-8"))
            ids.append(self.special_ids[match.group(0)])
            pos = match.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        """ids -> text; invalid UTF-8 becomes U+FFFD; specials are written as their strings."""
        parts: list[str] = []
        buf = bytearray()
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i!r} is outside [0, {self.vocab_size})")
            if i < NUM_BYTES:
                buf.append(i)
                continue
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if not skip_special_tokens:
                parts.append(SPECIAL_TOKENS[i - NUM_BYTES])
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """[{"role", "content"}, ...] -> prompt string (encode it to get ids)."""
        out = ["<|bos|>"]
        for k, msg in enumerate(messages):
            ok = isinstance(msg, dict) and msg.get("role") in CHAT_ROLES and isinstance(msg.get("content"), str)
            if not ok:
                raise ValueError(f"message {k} must be {{'role': one of {CHAT_ROLES}, 'content': str}}, got {msg!r}")
            out.append(f"<|{msg['role']}|>{msg['content']}<|eos|>")
        if add_generation_prompt:
            out.append("<|assistant|>")
        return "".join(out)

    def to_config(self) -> dict:
        """The ``tokenizer_config.json`` describing this tokenizer."""
        return {
            "tokenizer_class": TOKENIZER_CLASS,
            "vocab_size": self.vocab_size,
            "byte_ids": [0, NUM_BYTES - 1],
            "special_tokens": dict(self.special_ids),
            "bos_token": "<|bos|>",
            "eos_token": "<|eos|>",
            "pad_token": "<|pad|>",
            "chat_template": "<|bos|>{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|eos|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}",
        }

    def save(self, out_dir: str | Path) -> Path:
        """Write ``tokenizer_config.json`` (sorted keys, deterministic) into out_dir."""
        path = Path(out_dir) / "tokenizer_config.json"
        path.write_text(json.dumps(self.to_config(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ByteTokenizer:
        """Load from a directory whose ``tokenizer_config.json`` names this tokenizer."""
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer_config.json in {model_dir}")
        data = json.loads(path.read_text())
        if data.get("tokenizer_class") != TOKENIZER_CLASS:
            raise ValueError(f"{path} describes {data.get('tokenizer_class')!r}, not {TOKENIZER_CLASS!r}")
        tok = cls()
        if data.get("special_tokens") != tok.special_ids:
            raise ValueError(f"{path} special_tokens differ from this tokenizer's {tok.special_ids}")
        return tok
