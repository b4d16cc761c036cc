"""``Tokenizer``: what the OpenAI layer needs of a tokenizer (the services pass theirs in; the model
library's ``ByteTokenizer`` is one)."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    """Text <-> token ids, the chat template, and the vocabulary size prompt ids are checked against."""

    vocab_size: int

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...
