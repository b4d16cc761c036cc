"""The one client-side reader of an OpenAI-style server-sent event stream: the JSON event of each
``data: {...}`` line, whether the stream ended with ``data: [DONE]``, the token ids of an event.

Every bench, check and test client that reads a streamed completion reads it here; an event that
carries an ``error`` is the caller's to judge (each reports it in its own terms).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

DONE = "data: [DONE]"


class StreamTruncated(RuntimeError):
    """The stream ended without ``data: [DONE]`` (the server or the connection cut it short)."""


def sse_events(lines: Iterable[bytes], *, require_done: bool = False, until_done: bool = False) -> Iterator[dict]:
    """The JSON events of a streamed response's lines, in order, read to the end of the stream
    (other lines, ``data: [DONE]`` among them, skipped), or with ``until_done`` up to the first
    ``data: [DONE]`` (a fault run must not wait on a connection a stopped server keeps open). With
    ``require_done``, a stream that ends without ``data: [DONE]`` raises StreamTruncated after its
    last event."""
    done = False
    for raw in lines:
        line = raw.decode().strip()
        if line == DONE:
            done = True
            if until_done:
                break
        elif line.startswith("data: {"):
            yield json.loads(line[6:])
    if require_done and not done:
        raise StreamTruncated(f"the stream ended without {DONE}")


def token_ids(event: dict) -> list[int]:
    """The token ids an event carries, over its choices in order (``token_ids``; none when absent)."""
    return [t for choice in event["choices"] for t in choice.get("token_ids", [])]
