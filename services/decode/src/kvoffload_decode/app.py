"""The decode's OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions`` (SSE or
JSON), ``/v1/models``, ``/health``, ``/metrics``, ``/reset_prefix_cache``.

A request must come through the proxy (``kv_transfer_params.do_remote_prefill``): the decode admits
it, tells the proxy's metaserver where to push the KV (an HTTP error there fails the request; only
transport errors are retried), waits for the pulled prompt and the prefill's first token, then
streams what the loop samples. A client disconnect cancels the request and frees everything.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web
from dsamodel.openai import RequestError, prompt_ids, sampling_params
from dsamodel.tokenizer import ByteTokenizer
from svcruntime.logs import REQUEST_IDS
from svcruntime.serving import DRAINING, refuse_while_draining
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from kvoffload_decode.loop import DecodeFull, DecodeLoop

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class AppSettings:
    model_name: str
    max_model_len: int
    advertise_host: str
    control_port: int
    metaserver_timeout_s: float = 600.0
    token_timeout_s: float = 600.0
    metaserver_retries: int = 3
    admission_wait_s: float = 300.0  # a request waits this long for a free sequence slot


class Metrics:
    def __init__(self, loop: DecodeLoop, transfer) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvoffload_decode_requests", "Requests by outcome", ["outcome"], registry=self.registry)
        self.hit_rate = Gauge("kvoffload_decode_hot_cache_hit_rate", "Hot-cache hit rate of the last step",
                              registry=self.registry)
        self.layer_hit_rate = Gauge("kvoffload_decode_hot_cache_hit_rate_by_layer",
                                    "Hot-cache hit rate of the last step, per cache layer", ["layer"],
                                    registry=self.registry)
        self.h2d = Gauge("kvoffload_decode_h2d_bytes_per_step", "Host-to-device bytes of the last step",
                         registry=self.registry)
        self.pool_used = Gauge("kvoffload_decode_pool_used_bytes", "Host-pool bytes in use", registry=self.registry)
        self.reads = Gauge("kvoffload_decode_read_done_total", "Layer pulls answered READ_DONE", registry=self.registry)
        self.read_ms = Gauge("kvoffload_decode_read_done_ms_avg", "Average READ_DONE latency (ms)",
                             registry=self.registry)
        self.loop, self.transfer = loop, transfer

    def render(self) -> bytes:
        st = self.loop.decoder.last_step
        self.hit_rate.set(st.hit_rate)
        for layer in set(st.layer_hits) | set(st.layer_misses):
            self.layer_hit_rate.labels(str(layer)).set(st.layer_hit_rate(layer))
        self.h2d.set(st.h2d_bytes)
        self.pool_used.set(self.loop.decoder.pool.stats().used_bytes)
        c = self.transfer.counters
        self.reads.set(c["read_done"])
        self.read_ms.set(c["read_ms_total"] / c["read_done"] if c["read_done"] else 0.0)
        return generate_latest(self.registry)


def build_app(loop: DecodeLoop, transfer, tokenizer: ByteTokenizer, settings: AppSettings) -> web.Application:
    metrics = Metrics(loop, transfer)
    app = web.Application(client_max_size=32 << 20, middlewares=[refuse_while_draining("decode")])
    app[DRAINING] = asyncio.Event()
    handler = _Handler(loop, tokenizer, settings, metrics)
    app.router.add_post("/v1/completions", lambda r: handler.complete(r, chat=False))
    app.router.add_post("/v1/chat/completions", lambda r: handler.complete(r, chat=True))
    app.router.add_get("/health", handler.health)
    app.router.add_get("/v1/models", handler.models)  # the proxy's GET /v1/models merges these
    app.router.add_get("/metrics", lambda r: web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}))
    app.router.add_post("/reset_prefix_cache", lambda r: web.json_response({"status": "ok", "note": "decode keeps no prefix cache"}))
    return app


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": code, "code": status}}, status=status)


class _Handler:
    def __init__(self, loop: DecodeLoop, tokenizer: ByteTokenizer, settings: AppSettings, metrics: Metrics) -> None:
        self.loop, self.tokenizer, self.settings, self.metrics = loop, tokenizer, settings, metrics
        self.created = int(time.time())

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI model list: the served model name (--served-model-name, default the model
        directory's name), the one id this decode answers to."""
        return web.json_response({"object": "list", "data": [{
            "id": self.settings.model_name, "object": "model", "created": self.created,
            "owned_by": "kvoffload", "max_model_len": self.settings.max_model_len}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **self.loop.stats()})

    async def complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("body: must be a JSON object")
            ids = prompt_ids(body, self.tokenizer, chat=chat)
            params = sampling_params(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "body: malformed JSON", "invalid_request_error")
        except RequestError as exc:
            return _error(400, str(exc), "invalid_request_error")
        if len(ids) + params.max_tokens > self.settings.max_model_len:
            return _error(400, f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                               f"max_model_len={self.settings.max_model_len}", "invalid_request_error")
        ktp = body.get("kv_transfer_params") or {}
        if not isinstance(ktp, dict) or not ktp.get("do_remote_prefill") or not ktp.get("metaserver"):
            return _error(400, "kv_transfer_params: this decode node serves requests with a remote prefill "
                               "(do_remote_prefill and metaserver, as the proxy sends them)", "invalid_request_error")
        rid = str(ktp.get("request_id") or request.headers.get("X-Request-Id") or f"cmpl-{uuid.uuid4().hex}")
        bound = log.bind(request_id=rid)
        queue: asyncio.Queue = asyncio.Queue()
        failed = asyncio.Event()  # set with the first error: the watchdog may fail a request early
        aio = asyncio.get_running_loop()

        def emit(kind: str, value: object) -> None:
            aio.call_soon_threadsafe(queue.put_nowait, (kind, value))
            if kind == "error":
                aio.call_soon_threadsafe(failed.set)

        try:
            await asyncio.to_thread(self.loop.expect_remote, rid, ids, params, emit, self.settings.admission_wait_s)
        except DecodeFull as exc:
            return _error(503, str(exc), "overloaded")
        except ValueError as exc:
            return _error(409, str(exc), "invalid_request_error")
        REQUEST_IDS.link(rid, request.headers.get("X-Request-Id"))  # log lines carry the proxy's id
        bound.info("request_admitted", prompt_tokens=len(ids), max_tokens=params.max_tokens)
        done = False
        try:
            self.loop.awaiting_prefill(rid)
            problem = await self._register_unless_failed(rid, ktp["metaserver"], bound, queue, failed,
                                                         _metaserver_token(ktp))
            if not problem:  # the prefill reported done before the metaserver answered: all KV must be here
                problem = self.loop.check_prompt_complete(rid)
            if problem:
                self.metrics.requests.labels("prefill_failed").inc()
                return _error(502, problem, "prefill_failed")
            if body.get("stream"):
                response = await self._stream(request, rid, queue, chat, len(ids))
            else:
                response = await self._collect(rid, queue, chat, len(ids))
            done = True
            return response
        finally:
            if not done:
                self.loop.cancel(rid, "the client request ended early")
                self.metrics.requests.labels("cancelled").inc()
            REQUEST_IDS.unlink(rid)

    async def _register_unless_failed(self, rid: str, metaserver: str, bound, queue: asyncio.Queue,
                                      failed: asyncio.Event, token: str | None = None) -> str:
        """``_register``, cut short when the request fails meanwhile (its prefill went quiet):
        the metaserver's answer can take the whole prefill, a dead prefill must not."""
        register = asyncio.ensure_future(self._register(rid, metaserver, bound, token))
        failure = asyncio.ensure_future(failed.wait())
        try:
            await asyncio.wait({register, failure}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failure.cancel()
        if register.done():
            return register.result()
        register.cancel()
        while True:  # the error the request failed with (tokens before it are dropped: it failed)
            kind, value = queue.get_nowait()
            if kind == "error":
                bound.warning("request_failed_while_prefilling", reason=str(value))
                return str(value)

    async def _register(self, rid: str, metaserver: str, bound, token: str | None = None) -> str:
        """POST our endpoint to the proxy's metaserver; "" when it answered ok, else what failed.
        ``token``: the proxy's per-request ``metaserver_token`` (set when the proxy has an API key)."""
        headers = {"X-Request-Id": rid, **({"Authorization": f"Bearer {token}"} if token else {})}
        params = {"request_id": rid, "remote_host": self.settings.advertise_host,
                  "remote_port": self.settings.control_port, "remote_tp_size": 1, "remote_dp_rank": 0}
        payload = {"request_id": rid, "kv_transfer_params": params}
        timeout = aiohttp.ClientTimeout(total=self.settings.metaserver_timeout_s)
        attempt = 0
        while True:
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    async with session.post(metaserver, json=payload, headers=headers) as resp:
                        text = await resp.text()
                        if resp.status // 100 == 2:
                            return ""
                        bound.warning("metaserver_error", status=resp.status, body=text[:500])
                        return f"metaserver {metaserver} answered {resp.status}: {text[:500]}"
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                if attempt == self.settings.metaserver_retries:
                    return f"metaserver {metaserver} unreachable after {attempt + 1} attempts: {exc!r}"
                await asyncio.sleep(0.2 * 2**attempt)
                attempt += 1

    async def _next(self, queue: asyncio.Queue) -> tuple[str, object]:
        return await asyncio.wait_for(queue.get(), timeout=self.settings.token_timeout_s)

    def _chunk(self, rid: str, chat: bool, text: str, token_ids: list[int], finish: str | None, first: bool) -> dict:
        created = int(time.time())
        if chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": 0, "delta": delta, "token_ids": token_ids, "finish_reason": finish}
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": self.settings.model_name, "choices": [choice]}
        choice = {"index": 0, "text": text, "token_ids": token_ids, "logprobs": None, "finish_reason": finish}
        return {"id": rid, "object": "text_completion", "created": created, "model": self.settings.model_name,
                "choices": [choice]}

    async def _stream(self, request: web.Request, rid: str, queue, chat: bool, n_prompt: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": rid})
        await resp.prepare(request)
        ids: list[int] = []
        sent = ""
        while True:
            try:
                kind, value = await self._next(queue)
            except asyncio.TimeoutError:
                kind, value = "error", f"no token for {self.settings.token_timeout_s} s"
            if kind == "error":
                self.metrics.requests.labels("error").inc()
                await resp.write(f"data: {json.dumps({'error': {'message': value, 'type': 'decode_error'}})}\n\n".encode())
                self.loop.cancel(rid, str(value))
                break
            if kind == "done":
                chunk = self._chunk(rid, chat, "", [], str(value), False)
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.metrics.requests.labels("ok").inc()
                break
            ids.append(int(value))
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            piece, sent = text[len(sent):], text
            await resp.write(f"data: {json.dumps(self._chunk(rid, chat, piece, [int(value)], None, len(ids) == 1))}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _collect(self, rid: str, queue, chat: bool, n_prompt: int) -> web.Response:
        ids: list[int] = []
        while True:
            try:
                kind, value = await self._next(queue)
            except asyncio.TimeoutError:
                self.loop.cancel(rid, "token timeout")
                return _error(504, f"no token for {self.settings.token_timeout_s} s", "timeout")
            if kind == "error":
                self.metrics.requests.labels("error").inc()
                return _error(500, str(value), "decode_error")
            if kind == "done":
                finish = str(value)
                break
            ids.append(int(value))
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self.metrics.requests.labels("ok").inc()
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(ids), "total_tokens": n_prompt + len(ids)}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "token_ids": ids,
                      "finish_reason": finish}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        return web.json_response({"id": rid, "object": obj, "created": int(time.time()),
                                  "model": self.settings.model_name, "choices": [choice], "usage": usage},
                                 headers={"X-Request-Id": rid})


def _metaserver_token(ktp: dict) -> str | None:
    """The bearer token the proxy issued for this request's /v1/metaserver call (see the proxy's
    auth.py), or None; anything but a short token of visible ASCII is ignored, never sent."""
    token = ktp.get("metaserver_token")
    if isinstance(token, str) and 0 < len(token) <= 256 and all("!" <= c <= "~" for c in token):
        return token
    return None
