"""The prefill's HTTP API in offload-only mode (no ``SfaRemoteD2HConnector``: ``generate.GenerateLoop``
serves complete requests): ``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE, the
OpenAI parameters of ``openai_api``; one choice per request), ``/v1/models``, ``/health``,
``/metrics`` and ``/reset_prefix_cache``. A request with ``kv_transfer_params`` is refused: nothing
pulls from this node. A client that goes away cancels its request."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import structlog
from aiohttp import web

from kvoffload_prefill.generate import GenerateLoop
from kvoffload_prefill.metrics import PrefillMetrics
from openai_api.body import RequestError
from openai_api.output import Output, Responder
from openai_api.request import ParsedRequest, parse_request
from openai_api.tokenizer import Tokenizer
from svcruntime.serving import draining_app, error_response
from svcruntime.sse import sse_response

log = structlog.get_logger(__name__)
MODE = "offload-only"


class Metrics(PrefillMetrics):
    def __init__(self, loop: GenerateLoop) -> None:
        super().__init__(loop.engine.prefill_pool)
        self.loop = loop
        self.running = self.gauge("kvoffload_prefill_running_requests", "Requests in the decode batch")
        self.waiting = self.gauge("kvoffload_prefill_waiting_requests", "Requests waiting for their prefill")
        self.prompt = self.gauge("kvoffload_prefill_prompt_tokens_total", "Prompt tokens of finished requests")
        self.cached = self.gauge(
            "kvoffload_prefill_cached_tokens_total",
            "Prompt tokens of finished requests loaded from the host pool (prefix cache)",
        )

    def update(self) -> None:
        st = self.loop.stats()
        self.running.set(st["running"])
        self.waiting.set(st["waiting"])
        self.prompt.set(st["prompt_tokens"])
        self.cached.set(st["cached_tokens"])


def build_offload_app(
    loop: GenerateLoop,
    tokenizer: Tokenizer,
    model_name: str,
    max_model_len: int,
    not_ready: Callable[[], str] = lambda: "",
    token_timeout_s: float = 600.0,
) -> web.Application:
    """``not_ready()`` says why the node cannot serve now ("" when it can)."""
    metrics = Metrics(loop)
    handler = _Handler(loop, tokenizer, Responder(tokenizer, model_name), metrics, max_model_len, token_timeout_s)
    created = int(time.time())
    app = draining_app("prefill")

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "created": created,
                        "owned_by": "kvoffload",
                        "max_model_len": max_model_len,
                    }
                ],
            }
        )

    async def health(request: web.Request) -> web.Response:
        reason = not_ready()
        body = {"status": "not_ready" if reason else "ok", "mode": MODE, **loop.stats()}
        return web.json_response({**body, "reason": reason} if reason else body, status=503 if reason else 200)

    async def reset(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **await asyncio.to_thread(loop.reset_prefix_cache)})

    app.router.add_post("/v1/completions", lambda r: handler.complete(r, False))
    app.router.add_post("/v1/chat/completions", lambda r: handler.complete(r, True))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics.handle)
    app.router.add_post("/reset_prefix_cache", reset)
    return app


class _Handler:
    """Complete requests, served by the ``GenerateLoop`` (module doc)."""

    def __init__(
        self,
        loop: GenerateLoop,
        tokenizer: Tokenizer,
        responder: Responder,
        metrics: Metrics,
        max_model_len: int,
        token_timeout_s: float,
    ) -> None:
        self.loop, self.tokenizer, self.responder, self.metrics = loop, tokenizer, responder, metrics
        self.max_model_len, self.token_timeout_s = max_model_len, token_timeout_s

    async def complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        parsed = await self._parse(request, chat)
        if isinstance(parsed, web.Response):
            return parsed
        ids, params = parsed.prompt_ids, parsed.params
        rid = request.headers.get("X-Request-Id") or f"cmpl-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()

        def emit(kind: str, value: object) -> None:
            aio.call_soon_threadsafe(queue.put_nowait, (kind, value))

        try:
            sampler = self.loop.submit(rid, ids, params, emit)
        except ValueError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        except RuntimeError as exc:
            return error_response(503, str(exc), "unavailable")
        log.info("request_accepted", request_id=rid, mode=MODE, prompt_tokens=len(ids), max_tokens=params.max_tokens)
        out = self.responder.output(parsed.body, params, ids, sampler.logprobs.__getitem__, chat=chat)
        done = False
        try:
            if parsed.stream:
                response = await sse_response(
                    request,
                    rid,
                    self.responder.events(
                        rid,
                        lambda: self._next(queue),
                        out,
                        len(ids),
                        parsed.include_usage,
                        lambda message: self.metrics.requests.labels("error").inc(),
                        lambda: self.metrics.requests.labels("ok").inc(),
                    ),
                )
            else:
                response = await self._collect(rid, queue, out, len(ids))
            done = True
            return response
        finally:
            if not done:
                self.loop.cancel(rid)
                self.metrics.requests.labels("cancelled").inc()

    async def _parse(self, request: web.Request, chat: bool) -> ParsedRequest | web.Response:
        """The request, or the 400 that refuses it."""
        try:
            return parse_request(
                await request.read(),
                self.tokenizer,
                chat=chat,
                max_model_len=self.max_model_len,
                refuse=_offload_only_refusals,
            )
        except RequestError as exc:
            return error_response(400, str(exc), "invalid_request_error")

    async def _next(self, queue: asyncio.Queue) -> tuple[str, object]:
        try:
            return await asyncio.wait_for(queue.get(), timeout=self.token_timeout_s)
        except asyncio.TimeoutError:
            return "error", f"no token for {self.token_timeout_s} s"

    async def _collect(self, rid: str, queue: asyncio.Queue, out: Output, n_prompt: int) -> web.Response:
        obj, error = await self.responder.collect(rid, lambda: self._next(queue), out, n_prompt)
        if obj is None:
            self.metrics.requests.labels("error").inc()
            return error_response(500, error, "generation_error")
        self.metrics.requests.labels("ok").inc()
        return web.json_response(obj, headers={"X-Request-Id": rid})


def _offload_only_refusals(body: dict) -> None:
    """What this mode refuses before the common checks: P/D wiring (nothing pulls from this node) and
    more than one choice."""
    if body.get("kv_transfer_params") is not None or body.get("kv_transfer_params_list") is not None:
        raise RequestError(
            "kv_transfer_params: this prefill runs offload-only (its kv-transfer-config has no "
            "SfaRemoteD2HConnector): it serves complete requests and no decode pulls from it"
        )
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise RequestError(f"n: offload-only mode returns one choice per request (got n={n})")
