"""StopText: stop strings found where they end, text held back while it could still become one or
is an unfinished UTF-8 character, and nothing at or after a stop string ever released."""

import pytest

from dsamodel.tokenizer import ByteTokenizer
from openai_api.stop_text import StopText, find_stop

TOK = ByteTokenizer()
DECODE = lambda ids: TOK.decode(ids, skip_special_tokens=True)  # noqa: E731


def test_find_stop_ignores_occurrences_ending_early():
    assert find_stop("abcab", ("ab",)) == 0
    assert find_stop("abcab", ("ab",), after=2) == 3
    assert find_stop("abc", ("x", "c", "bc")) == 1


def test_stop_text_holds_back_possible_stop_prefixes():
    st = StopText(DECODE, ("STOP",))
    released = []
    for ch in b"go ST":
        st.add(ch)
        released.append(st.take()[0])
    assert "".join(released) == "go "  # "ST" may still become "STOP"
    st.add(ord("A"))
    assert st.take()[0] == "STA"
    for ch in b"STOP!":
        st.add(ch)
    text, tokens = st.take(final=True)
    assert text == "" and st.stop_at == 6 and [t for t, _ in tokens] == []
    assert "".join(released) + "STA" == st.text[: st.stop_at]


def test_stop_text_waits_for_whole_utf8_characters():
    st = StopText(DECODE)
    pieces = []
    for b in "é€".encode():
        st.add(b)
        pieces.append(st.take()[0])
    assert pieces == ["", "é", "", "", "€"]
    assert st.take(final=True) == ("", [])


@pytest.mark.parametrize("seed", range(20))
def test_stop_text_streams_exactly_the_text_before_the_stop(seed):
    import random

    rng = random.Random(seed)
    alphabet = list(b"ab7 ") + list("é€".encode()) + [0x80, 0xE2, TOK.eos_token_id]
    ids = [rng.choice(alphabet) for _ in range(40)]
    stop = ("7a", "€b", "ab ")
    st = StopText(DECODE, stop)
    pieces, tokens = [], []
    for t in ids:
        st.add(t)
        piece, toks = st.take()
        pieces.append(piece)
        tokens += toks
    piece, toks = st.take(final=True)
    pieces.append(piece)
    tokens += toks
    full = DECODE(ids)
    cut = min([i for i in (full.find(s) for s in stop) if i >= 0], default=len(full))
    assert "".join(pieces) == full[:cut]
    assert not any(s in p for p in pieces for s in stop)
    assert DECODE([t for t, _ in tokens]) == full[:cut]
