"""Server-sent events over aiohttp: one JSON object per ``data:`` line, ``data: [DONE]`` last (the
OpenAI streaming format both model services answer with)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from aiohttp import web


async def sse_response(request: web.Request, rid: str, events: AsyncIterator[dict]) -> web.StreamResponse:
    """Stream ``events`` to the client as SSE (headers ``X-Request-Id: rid``), then ``[DONE]``."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": rid}
    )
    await resp.prepare(request)
    async for obj in events:
        await resp.write(f"data: {json.dumps(obj)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
