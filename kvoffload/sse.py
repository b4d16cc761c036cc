"""Reading an OpenAI-style server-sent event stream: the JSON event of each ``data: {...}`` line."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator


def sse_events(lines: Iterable[bytes]) -> Iterator[dict]:
    """The JSON events of a streamed response's lines, in order (other lines, ``data: [DONE]``
    among them, skipped)."""
    for raw in lines:
        line = raw.decode().strip()
        if line.startswith("data: {"):
            yield json.loads(line[6:])
