"""Decoder output -> client response, keeping the OpenAI shapes.

Children are merged: child `i * n + j` is choice j of prompt i (one choice per decoder request),
every object gets the parent's id, choice `index` becomes the child's number (OpenAI's order for
prompt lists and `n`), usage is summed with each prompt's tokens counted once, not once per choice
(streamed usage-only chunks are held back and sent once, summed, before `[DONE]`).
Decoder-internal `kv_transfer_params` are dropped. A failure before the first byte is a plain HTTP
error; after it, an SSE `data: {"error": ...}` event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from .errors import ProxyError

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_response(err: ProxyError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers={**err.headers, **(headers or {})})


def remap(obj: dict[str, Any], child: int, n: int, response_id: str) -> dict[str, Any]:
    obj = dict(obj)
    obj["id"] = response_id
    obj.pop("kv_transfer_params", None)
    if isinstance(obj.get("choices"), list):
        choices = []
        for c in obj["choices"]:
            if isinstance(c, dict):
                c = dict(c)
                idx = c.get("index", 0)
                c["index"] = child * n + (idx if isinstance(idx, int) else 0)
            choices.append(c)
        obj["choices"] = choices
    return obj


def child_usage(usage: Any, child: int, n: int) -> Any:
    """A child's usage as it counts toward the total: choices after a prompt's first repeat its
    prompt, which OpenAI counts once."""
    if n <= 1 or child % n == 0 or not isinstance(usage, dict):
        return usage
    usage = dict(usage)
    prompt = usage.pop("prompt_tokens", 0)
    if isinstance(usage.get("total_tokens"), int) and isinstance(prompt, int):
        usage["total_tokens"] -= prompt
    return usage


def add_usage(total: dict[str, Any] | None, usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return total
    total = dict(total or {})
    for k, v in usage.items():
        if isinstance(v, int) and not isinstance(v, bool):
            total[k] = total.get(k, 0) + v
        else:
            total.setdefault(k, v)
    return total


class JsonRelay:
    def __init__(self, response_id: str, headers: dict[str, str], n: int):
        self.response_id, self.headers, self.n = response_id, headers, n
        self.results: dict[int, dict[str, Any]] = {}
        self.response = None

    async def add(self, child: int, obj: dict[str, Any]) -> None:
        self.results[child] = obj

    def merged(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        choices: list[Any] = []
        usage = None
        for child in sorted(self.results):
            obj = remap(self.results[child], child, 1, self.response_id)
            merged = merged or obj
            choices.extend(obj.get("choices") or [])
            usage = add_usage(usage, child_usage(obj.get("usage"), child, self.n))
        merged["choices"] = choices
        if usage is not None:
            merged["usage"] = usage
        return merged

    async def finish(self) -> web.StreamResponse:
        return web.json_response(self.merged(), headers=self.headers)

    async def fail(self, err: ProxyError) -> web.StreamResponse:
        return error_response(err, self.headers)

    async def abort(self, err: ProxyError) -> None:
        pass


class StreamRelay:
    def __init__(self, request: web.Request, response_id: str, headers: dict[str, str], n: int, write_timeout_s: float):
        self.request, self.response_id, self.headers, self.n = request, response_id, headers, n
        self.write_timeout_s = write_timeout_s
        self.response: web.StreamResponse | None = None
        self.usage: dict[str, Any] | None = None
        self.last: dict[str, Any] = {}

    async def _send(self, payload: str, timeout_s: float | None = None) -> web.StreamResponse:
        """Send one event (the first one opens the stream); returns the stream."""
        if self.response is None:
            self.response = web.StreamResponse(headers={**SSE_HEADERS, **self.headers})
            await self.response.prepare(self.request)
        await asyncio.wait_for(self.response.write(f"data: {payload}\n\n".encode()), timeout_s or self.write_timeout_s)
        return self.response

    async def add(self, child: int, obj: dict[str, Any]) -> None:
        obj = remap(obj, child, 1, self.response_id)
        self.last = obj
        if obj.get("usage") and not obj.get("choices"):
            self.usage = add_usage(self.usage, child_usage(obj["usage"], child, self.n))  # sent once at the end
            return
        await self._send(json.dumps(obj, separators=(",", ":")))

    async def finish(self) -> web.StreamResponse:
        if self.usage is not None:
            chunk = {k: self.last[k] for k in ("object", "created", "model") if k in self.last}
            await self._send(
                json.dumps({"id": self.response_id, **chunk, "choices": [], "usage": self.usage}, separators=(",", ":"))
            )
        response = await self._send("[DONE]")
        await response.write_eof()
        return response

    async def fail(self, err: ProxyError) -> web.StreamResponse:
        if self.response is None:
            return error_response(err, self.headers)
        await self.abort(err)
        return self.response

    async def abort(self, err: ProxyError) -> None:
        """Best effort: tell a client that already got a 200 why its stream ends."""
        if self.response is None:
            return
        try:
            await self._send(json.dumps({"error": err.error_object()}, separators=(",", ":")), 1.0)
            await self._send("[DONE]", 1.0)
            await asyncio.wait_for(self.response.write_eof(), 1.0)
        except (ConnectionResetError, asyncio.TimeoutError, RuntimeError):
            pass
