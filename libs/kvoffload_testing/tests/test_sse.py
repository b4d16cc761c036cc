"""kvoffload_testing.sse: the one reader of a streamed completion (events, [DONE], token ids)."""

from __future__ import annotations

import pytest

from kvoffload_testing.sse import StreamTruncated, sse_events, token_ids

STREAM = [
    b'data: {"choices": [{"token_ids": [1, 2]}]}\n',
    b"\n",
    b": keep-alive\n",
    b'data: {"choices": [{"token_ids": [3]}, {"text": "x"}]}\n',
    b"\n",
    b"data: [DONE]\n",
    b"\n",
]


def test_events_in_order_other_lines_and_done_skipped():
    events = list(sse_events(STREAM, require_done=True))
    assert [token_ids(e) for e in events] == [[1, 2], [3]]


def test_an_error_event_is_an_event():
    events = list(sse_events([b'data: {"error": {"message": "m", "code": 502}}\n', b"data: [DONE]\n"]))
    assert events == [{"error": {"message": "m", "code": 502}}]


def test_a_stream_without_done_is_truncated_only_when_done_is_required():
    cut = STREAM[:4]
    assert len(list(sse_events(cut))) == 2
    got = []
    with pytest.raises(StreamTruncated, match=r"the stream ended without data: \[DONE\]"):
        for event in sse_events(cut, require_done=True):
            got.append(event)
    assert len(got) == 2  # every event before the cut was given first


def test_until_done_stops_reading_at_the_first_done():
    """A fault run returns at [DONE]: nothing after it is read (a stopped server may keep the connection open)."""

    def lines():
        yield b'data: {"choices": [{"token_ids": [1]}]}\n'
        yield b"data: [DONE]\n"
        raise AssertionError("read past [DONE]")

    assert [token_ids(e) for e in sse_events(lines(), require_done=True, until_done=True)] == [[1]]
