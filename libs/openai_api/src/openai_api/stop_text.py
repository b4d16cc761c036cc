"""``StopText``: generated tokens -> the text a client sees, cut before the first stop string and
released in pieces that never hold (a prefix of) a stop string still undecided; ``find_stop``
finds the earliest stop string. The sampler ends a sequence with the same matcher the output
layer cuts its text with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def find_stop(text: str, stop: tuple[str, ...], after: int = 0) -> int:
    """Index in ``text`` where the earliest stop string begins, among those ending past ``after``
    chars (occurrences ending at or before it are ignored), or -1."""
    hits = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stop) if i >= 0]
    return min(hits) if hits else -1


def _is_byte(token: int) -> bool:
    return 0 <= token < 256  # the byte tokenizer: ids 0..255 are UTF-8 bytes, the rest specials


class StopText:
    """Output tokens -> client text, cut before the first stop string (byte tokenizer ids).

    ``add(token, extra)`` then ``take()`` returns ``(text, [(token, extra), ...])``: the text and the
    tokens that may be shown now. Text that could still become a stop string (a suffix equal to a
    stop string's prefix) or an unfinished UTF-8 character is held back until decided;
    ``take(final=True)`` releases the rest. Once a stop string appeared, nothing at or after it is
    ever released, and neither are the tokens whose text reaches into it. A stop string counts
    only when it ends in the text of token ``min_tokens`` or later.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (), *, min_tokens: int = 0) -> None:
        self._decode, self.stop, self.min_tokens = decode, tuple(stop), min_tokens
        self.ids: list[int] = []
        self._extra: list[Any] = []
        self._ends: list[int] = []  # per token: length of the stable text up to and including it
        self._base, self._base_text = 0, ""  # a prefix of ids whose text is final (ends at a boundary)
        self._checked = 0  # text length whose stop strings were ruled out
        self._sent_tokens = self._sent_chars = 0
        self.stop_at = -1  # index in the text where a stop string begins, once seen
        self.text = ""

    def _stable_len(self) -> int:
        """Length of the text without a trailing unfinished UTF-8 sequence."""
        ids, k, tail = self.ids, len(self.ids), 0
        while k > self._base and tail < 3 and _is_byte(ids[k - 1]) and 0x80 <= ids[k - 1] < 0xC0:
            k, tail = k - 1, tail + 1
        if k > self._base and _is_byte(ids[k - 1]) and ids[k - 1] >= 0xC0:
            lead = ids[k - 1]
            need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
            if tail + 1 < need:
                return len(self._base_text) + len(self._decode(ids[self._base : k - 1]))
        return len(self.text)

    def add(self, token: int, extra: Any = None) -> None:
        token = int(token)
        self.ids.append(token)
        self._extra.append(extra)
        self.text = self._base_text + self._decode(self.ids[self._base :])
        stable = self._stable_len()
        if stable == len(self.text):  # no unfinished character at the end: this text is final
            self._base, self._base_text = len(self.ids), self.text
        self._ends.append(stable)
        if self.stop_at < 0 and self.stop:
            if len(self.ids) >= self.min_tokens:
                self.stop_at = find_stop(self.text, self.stop, self._checked)
            self._checked = stable

    @property
    def stable_len(self) -> int:
        """Length of the text whose characters are final (no unfinished UTF-8 at its end)."""
        return self._ends[-1] if self._ends else 0

    def _held(self, text: str) -> int:
        """Chars at the end of ``text`` that are a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def take(self, final: bool = False) -> tuple[str, list[tuple[int, Any]]]:
        if self.stop_at >= 0:
            limit = self.stop_at
        elif final:
            limit = len(self.text)
        else:
            stable = self.text[: self._ends[-1]] if self._ends else ""
            limit = len(stable) - self._held(stable)
        limit = max(limit, self._sent_chars)
        piece = self.text[self._sent_chars : limit]
        self._sent_chars = limit
        tokens = []
        while self._sent_tokens < len(self.ids) and (
            self._ends[self._sent_tokens] <= limit or (final and self.stop_at < 0)
        ):
            k = self._sent_tokens
            tokens.append((self.ids[k], self._extra[k]))
            self._sent_tokens += 1
        return piece, tokens
