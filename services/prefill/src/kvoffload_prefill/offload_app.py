"""The prefill's HTTP API in offload-only mode (no ``SfaRemoteD2HConnector``: ``generate.GenerateLoop``
serves complete requests): ``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE, the
OpenAI parameters of ``dsamodel.openai``; one choice per request), ``/v1/models``, ``/health``,
``/metrics`` and ``/reset_prefix_cache``. A request with ``kv_transfer_params`` is refused: nothing
pulls from this node. A client that goes away cancels its request."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable

import structlog
from aiohttp import web
from dsamodel.openai import RequestError, check_body, prompt_ids, sampling_params
from dsamodel.openai_output import Output, Responder
from dsamodel.tokenizer import ByteTokenizer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from svcruntime.serving import DRAINING, refuse_while_draining
from svcruntime.sse import sse_response

from kvoffload_prefill.generate import GenerateLoop

log = structlog.get_logger(__name__)
MODE = "offload-only"


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": code, "code": status}}, status=status)


class Metrics:
    def __init__(self, loop: GenerateLoop) -> None:
        self.loop = loop
        self.registry = CollectorRegistry()
        self.requests = Counter("kvoffload_prefill_requests", "Requests by outcome", ["outcome"], registry=self.registry)
        self.running = Gauge("kvoffload_prefill_running_requests", "Requests in the decode batch",
                             registry=self.registry)
        self.waiting = Gauge("kvoffload_prefill_waiting_requests", "Requests waiting for their prefill",
                             registry=self.registry)
        self.prompt = Gauge("kvoffload_prefill_prompt_tokens_total", "Prompt tokens of finished requests",
                            registry=self.registry)
        self.cached = Gauge("kvoffload_prefill_cached_tokens_total",
                            "Prompt tokens of finished requests loaded from the host pool (prefix cache)",
                            registry=self.registry)
        self.pool_used = Gauge("kvoffload_prefill_pool_used_bytes", "Host-pool bytes in use", registry=self.registry)

    def render(self) -> bytes:
        st = self.loop.stats()
        self.running.set(st["running"])
        self.waiting.set(st["waiting"])
        self.prompt.set(st["prompt_tokens"])
        self.cached.set(st["cached_tokens"])
        self.pool_used.set(self.loop.engine.prefill_pool.stats().used_bytes)
        return generate_latest(self.registry)


def build_offload_app(loop: GenerateLoop, tokenizer: ByteTokenizer, model_name: str, max_model_len: int,
                      not_ready: Callable[[], str] = lambda: "", token_timeout_s: float = 600.0) -> web.Application:
    """``not_ready()`` says why the node cannot serve now ("" when it can)."""
    metrics = Metrics(loop)
    responder = Responder(tokenizer, model_name)
    created = int(time.time())
    app = web.Application(client_max_size=32 << 20, middlewares=[refuse_while_draining("prefill")])
    app[DRAINING] = asyncio.Event()

    async def complete(request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("body: must be a JSON object")
            if body.get("kv_transfer_params") is not None or body.get("kv_transfer_params_list") is not None:
                raise RequestError("kv_transfer_params: this prefill runs offload-only (its kv-transfer-config has no "
                                   "SfaRemoteD2HConnector): it serves complete requests and no decode pulls from it")
            n = body.get("n")
            if isinstance(n, int) and not isinstance(n, bool) and n > 1:
                raise RequestError(f"n: offload-only mode returns one choice per request (got n={n})")
            check_body(body, chat=chat)
            ids = prompt_ids(body, tokenizer, chat=chat)
            params = sampling_params(body, chat=chat)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "body: malformed JSON", "invalid_request_error")
        except RequestError as exc:
            return _error(400, str(exc), "invalid_request_error")
        if len(ids) + params.max_tokens > max_model_len:
            return _error(400, f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                               f"max_model_len={max_model_len}", "invalid_request_error")
        rid = request.headers.get("X-Request-Id") or f"cmpl-{uuid.uuid4().hex}"
        queue: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()

        def emit(kind: str, value: object) -> None:
            aio.call_soon_threadsafe(queue.put_nowait, (kind, value))

        try:
            sampler = loop.submit(rid, ids, params, emit)
        except ValueError as exc:
            return _error(400, str(exc), "invalid_request_error")
        except RuntimeError as exc:
            return _error(503, str(exc), "unavailable")
        log.info("request_accepted", request_id=rid, mode=MODE, prompt_tokens=len(ids), max_tokens=params.max_tokens)
        out = responder.output(body, params, ids, sampler.logprobs.__getitem__, chat=chat)
        done = False
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                response = await sse_response(request, rid, responder.events(
                    rid, lambda: _next(queue), out, len(ids), include_usage,
                    lambda message: metrics.requests.labels("error").inc(),
                    lambda: metrics.requests.labels("ok").inc()))
            else:
                response = await _collect(rid, queue, out, len(ids))
            done = True
            return response
        finally:
            if not done:
                loop.cancel(rid)
                metrics.requests.labels("cancelled").inc()

    async def _next(queue: asyncio.Queue) -> tuple[str, object]:
        try:
            return await asyncio.wait_for(queue.get(), timeout=token_timeout_s)
        except asyncio.TimeoutError:
            return "error", f"no token for {token_timeout_s} s"

    async def _collect(rid: str, queue: asyncio.Queue, out: Output, n_prompt: int) -> web.Response:
        obj, error = await responder.collect(rid, lambda: _next(queue), out, n_prompt)
        if obj is None:
            metrics.requests.labels("error").inc()
            return _error(500, error, "generation_error")
        metrics.requests.labels("ok").inc()
        return web.json_response(obj, headers={"X-Request-Id": rid})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "kvoffload",
            "max_model_len": max_model_len}]})

    async def health(request: web.Request) -> web.Response:
        reason = not_ready()
        body = {"status": "not_ready" if reason else "ok", "mode": MODE, **loop.stats()}
        return web.json_response({**body, "reason": reason} if reason else body, status=503 if reason else 200)

    async def reset(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **await asyncio.to_thread(loop.reset_prefix_cache)})

    app.router.add_post("/v1/completions", lambda r: complete(r, False))
    app.router.add_post("/v1/chat/completions", lambda r: complete(r, True))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", lambda r: web.Response(body=metrics.render(),
                                                          headers={"Content-Type": CONTENT_TYPE_LATEST}))
    app.router.add_post("/reset_prefix_cache", reset)
    return app
