"""Test support: async tests without plugins, fake prefiller/decoder HTTP servers, and a `stack`
fixture that runs the real proxy app in front of them (everything in-process, 127.0.0.1, free
ports).

The fakes implement the contract the proxy relies on:
- decoder: POST /v1/completions|/v1/chat/completions with kv_transfer_params
  {do_remote_prefill, metaserver, request_id}; POSTs {"request_id", "kv_transfer_params"} to the
  metaserver, and only if that answered 200 streams a few tokens (SSE) or returns JSON.
- prefiller: records every request it received and answers JSON (after `delay_s`).
Both serve GET /health and POST /reset_prefix_cache; decoders also GET /v1/models (their `model`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvoffload_proxy.app import FLOW, create_app
from kvoffload_proxy.config import parse_args

TEST_TIMEOUT_S = 30


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run `async def` tests in a fresh event loop, bounded so a hang fails instead of stalling."""
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    kwargs = {n: pyfuncitem.funcargs[n] for n in pyfuncitem._fixtureinfo.argnames}
    asyncio.run(asyncio.wait_for(pyfuncitem.obj(**kwargs), TEST_TIMEOUT_S))
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_app(app: web.Application, port: int = 0) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


class FakeBackend:
    def __init__(self, name: str, mode: str = "ok", delay_s: float = 0.0):
        self.name, self.mode, self.delay_s = name, mode, delay_s
        self.received: list[dict[str, Any]] = []
        self.headers: list = []
        self.paths: list[str] = []
        self.cancelled = 0
        self.resets = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_post("/reset_prefix_cache", self._reset)
        return app

    async def start(self) -> None:
        self.runner, self.port = await start_app(self.app())

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"}, status=500 if self.mode == "unhealthy" else 200)

    async def _reset(self, request: web.Request) -> web.Response:
        self.resets += 1
        return web.json_response({"status": "ok"})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        self.headers.append(request.headers.copy())
        self.paths.append(request.path)
        try:
            return await self.generate(request, body)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


class FakePrefiller(FakeBackend):
    def __init__(self, name: str, mode: str = "ok", delay_s: float = 0.0):
        super().__init__(name, mode, delay_s)
        self.done_at: list[float] = []

    async def generate(self, request, body):
        await asyncio.sleep(self.delay_s)
        if self.mode == "http500":
            return web.json_response({"error": {"message": "prefill exploded"}}, status=500)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        self.done_at.append(time.monotonic())
        return web.json_response(
            {
                "id": "cmpl-prefill",
                "object": "text_completion",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            }
        )


class FakeDecoder(FakeBackend):
    """Modes: ok, http500, reject400, hang (before registering; /v1/models never answers),
    no_register (waits, never registers), die_midstream (two events, then drops the connection),
    slow (0.3 s per token), flat_registration (POSTs its params themselves, request_id inside, as
    reference decoders), no_models (GET /v1/models is a 404, as a decoder without that route),
    no_wait (registers, then answers without waiting for the registration's answer, as a vLLM
    decode does once it pulled the layers: it may finish before the prefiller answered).
    `model` is the served model name: answers carry it, GET /v1/models lists it (after `delay_s`)."""

    def __init__(self, name: str, mode: str = "ok", delay_s: float = 0.0, index: int = 0):
        super().__init__(name, mode, delay_s)
        self.index = index
        self.model = "m"
        self.model_queries: list[dict] = []  # the headers of every GET /v1/models
        self.metaserver_answers: list[tuple[int, dict, float]] = []
        self.registrations: list[asyncio.Future] = []

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/v1/models", self._models)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        self.model_queries.append(request.headers.copy())
        await asyncio.sleep(self.delay_s)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "no_models":
            raise web.HTTPNotFound()
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": 1700000000, "owned_by": "fake"}],
            }
        )

    def endpoint_params(self, request_id: str) -> dict[str, Any]:
        return {
            "remote_host": "127.0.0.1",
            "remote_port": 30000 + 10 * self.index,
            "remote_dp_size": 1,
            "remote_tp_size": 1,
            "engine_id": self.name,
            "request_id": request_id,
        }

    async def register(self, ktp: dict[str, Any]) -> tuple[int, dict, float]:
        params = self.endpoint_params(ktp["request_id"])
        body = (
            params
            if self.mode == "flat_registration"  # the reference decoders' form
            else {"request_id": ktp["request_id"], "kv_transfer_params": params}
        )
        token = ktp.get("metaserver_token")  # issued by a proxy with --api-key, echoed as real decoders do
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with aiohttp.ClientSession() as s:
            async with s.post(ktp["metaserver"], json=body, headers=headers) as r:
                answer = (r.status, await r.json(), time.monotonic())
        self.metaserver_answers.append(answer)
        return answer

    async def generate(self, request, body):
        if self.mode == "http500":
            return web.json_response({"error": {"message": "decoder exploded"}}, status=500)
        if self.mode == "reject400":
            return web.json_response(
                {"error": {"message": "prompt is longer than max_model_len", "type": "BadRequestError", "code": 400}},
                status=400,
            )
        if self.mode in ("hang", "no_register"):
            await asyncio.sleep(3600)
        # shielded: the answer is recorded even when the proxy drops this request meanwhile
        registration = asyncio.ensure_future(self.register(body["kv_transfer_params"]))
        self.registrations.append(registration)
        if self.mode == "no_wait":
            await asyncio.sleep(0.1)  # registered by now; the answer is not awaited
            answer = (200, {}, time.monotonic())
        else:
            answer = await asyncio.shield(registration)
        if answer[0] != 200:
            return web.json_response({"error": {"message": f"metaserver refused: {answer[1]}"}}, status=502)
        prompt = body.get("prompt", "chat")
        tokens = [f"<{prompt}>", " a", " b"]
        chat = request.path.endswith("chat/completions")
        obj = "chat.completion" if chat else "text_completion"
        usage = {"prompt_tokens": 5, "completion_tokens": len(tokens), "total_tokens": 8}
        if not body.get("stream"):
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": "".join(tokens)}}
                if chat
                else {"index": 0, "text": "".join(tokens)}
            )
            return web.json_response(
                {
                    "id": "cmpl-decoder",
                    "object": obj,
                    "created": 1,
                    "model": self.model,
                    "choices": [{**choice, "finish_reason": "length"}],
                    "usage": usage,
                    "kv_transfer_params": {"x": 1},
                }
            )
        return await self._stream(request, body, tokens, chat, usage)

    async def _stream(self, request, body, tokens: list[str], chat: bool, usage: dict) -> web.StreamResponse:
        """The SSE answer: one event per token, the usage chunk when asked for, then [DONE]."""
        obj = "chat.completion" if chat else "text_completion"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k, tok in enumerate(tokens):
            if self.mode == "die_midstream" and k == 2:
                request.transport.close()
                return resp
            if self.mode == "slow":
                await asyncio.sleep(0.3)
            choice = {"index": 0, "delta": {"content": tok}} if chat else {"index": 0, "text": tok}
            event = {
                "id": "cmpl-decoder",
                "object": obj + ".chunk" if chat else obj,
                "created": 1,
                "model": self.model,
                "choices": [{**choice, "finish_reason": None}],
            }
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(
                f"data: {json.dumps({'id': 'x', 'object': obj, 'choices': [], 'usage': usage})}\n\n".encode()
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class Stack:
    """The real proxy app in front of fake backends; `args` are extra CLI flags."""

    def __init__(
        self, prefillers=("ok",), decoders=("ok",), args=(), prefill_delay_s=0.0, down_decoders=0, down_prefillers=0
    ):
        self.prefillers = [FakePrefiller(f"p{i}", m, prefill_delay_s) for i, m in enumerate(prefillers)]
        self.decoders = [FakeDecoder(f"d{i}", m, index=i) for i, m in enumerate(decoders)]
        self.args = list(args)
        self.down = (down_prefillers, down_decoders)

    async def __aenter__(self) -> Stack:
        for b in self.prefillers + self.decoders:
            await b.start()
        p_ports = [b.port for b in self.prefillers] + [free_port() for _ in range(self.down[0])]
        d_ports = [b.port for b in self.decoders] + [free_port() for _ in range(self.down[1])]
        self.port = free_port()
        self.config = parse_args(
            [
                "--port",
                str(self.port),
                "--prefiller-hosts",
                *["127.0.0.1"] * len(p_ports),
                "--prefiller-ports",
                *map(str, p_ports),
                "--decoder-hosts",
                *["127.0.0.1"] * len(d_ports),
                "--decoder-ports",
                *map(str, d_ports),
                "--retry-backoff-s",
                "0.01",
                "--connect-timeout-s",
                "1",
                "--request-timeout-s",
                "5",
                "--metaserver-timeout-s",
                "3",
                *self.args,
            ]
        )
        self.app = create_app(self.config)
        self.runner, _ = await start_app(self.app, self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()
        await self.runner.cleanup()
        for b in self.prefillers + self.decoders:
            await b.stop()

    async def post(self, path: str, body: Any, **kw) -> tuple[int, Any, aiohttp.ClientResponse]:
        async with self.http.post(self.url + path, json=body, **kw) as r:
            text = await r.text()
            try:
                data = json.loads(text)
            except ValueError:
                data = text
            return r.status, data, r

    @staticmethod
    async def until(cond, timeout_s: float = 2.0) -> bool:
        """Poll ``cond()`` until it holds or ``timeout_s`` passed; its last value."""
        deadline = time.monotonic() + timeout_s
        while not cond() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return cond()

    async def assert_idle(self) -> None:
        """Nothing leaked: no open rendezvous, no load left on any backend."""
        flow = self.app[FLOW]

        def idle() -> bool:
            return len(flow.registry) == 0 and flow.prefillers.is_idle and flow.decoders.is_idle and flow.in_flight == 0

        assert await self.until(idle), (len(flow.registry), flow.prefillers.loads, flow.decoders.loads, flow.in_flight)

    async def stream(self, path: str, body: Any, **kw) -> tuple[int, list[Any]]:
        async with self.http.post(self.url + path, json=body, **kw) as r:
            events = []
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))
            return r.status, events


@pytest.fixture
def stack():
    return Stack
