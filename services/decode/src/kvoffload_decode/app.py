"""The decode's OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions`` (SSE or
JSON), ``/v1/models``, ``/health``, ``/metrics``, ``/reset_prefix_cache``.

A request must come through the proxy (``kv_transfer_params.do_remote_prefill``): the decode admits
it, tells the proxy's metaserver where to push the KV (an HTTP error there fails the request; only
transport errors are retried), waits for the pulled prompt and the prefill's first token, then
streams what the loop samples. A client disconnect cancels the request and frees everything.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kvoffload_decode.admission import TooLarge
from kvoffload_decode.loop import DecodeLoop
from kvoffload_decode.metrics import Metrics
from kvoffload_decode.queue_wait import DecodeFull
from openai_api.body import RequestError
from openai_api.output import Output, Responder
from openai_api.request import ParsedRequest, parse_request
from openai_api.sampling_params import SamplingParams
from openai_api.tokenizer import Tokenizer
from openai_api.transfer_params import KVTransferParams
from pdlink.registration import RETRIES, Registration, backoff_s
from svcruntime.logs import REQUEST_IDS
from svcruntime.serving import draining_app, error_response, too_busy_response
from svcruntime.sse import sse_response

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class AppSettings:
    model_name: str
    max_model_len: int
    advertise_host: str
    control_port: int
    dp_rank: int = 0  # registered with the proxy as remote_dp_rank
    tp_size: int = 1  # registered as remote_tp_size: rank t of this decode listens on control_port + t
    metaserver_timeout_s: float = 600.0
    token_timeout_s: float = 600.0
    metaserver_retries: int = RETRIES


def build_app(
    loop: DecodeLoop, transfer, tokenizer: Tokenizer, settings: AppSettings, not_ready: Callable[[], str] = lambda: ""
) -> web.Application:
    """The HTTP API; ``not_ready()`` says why the decode cannot serve now ("" when it can: a TP
    decode whose rank died cannot), which ``/health`` answers with 503."""
    metrics = Metrics(loop, transfer)
    app = draining_app("decode")

    async def load_header(request: web.Request, response: web.StreamResponse) -> None:
        """Every answer carries the decode's load, which the proxy balances on."""
        response.headers[LOAD_HEADER] = encode_load(loop.load())

    app.on_response_prepare.append(load_header)
    handler = _Handler(loop, tokenizer, settings, metrics, not_ready)
    app.router.add_post("/v1/completions", partial(handler.complete, chat=False))
    app.router.add_post("/v1/chat/completions", partial(handler.complete, chat=True))
    app.router.add_get("/health", handler.health)
    app.router.add_get("/v1/models", handler.models)  # the proxy's GET /v1/models merges these

    async def render_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "note": "decode keeps no prefix cache"})

    app.router.add_get("/metrics", render_metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app


LOAD_HEADER = "X-Decode-Load"


def encode_load(load: dict[str, float]) -> str:
    """``queued=3;running=2;max_queued=64;free_slots=0;free_pool_bytes=123`` (``X-Decode-Load``)."""
    return ";".join(f"{k}={int(v)}" for k, v in load.items())


class _Events:
    """What the loop tells one request's handler, from the loop's threads: tokens and errors
    (``queue``; ``failed`` is set with the first error: the watchdog may fail a request early, and
    ``refused`` holds it when it is a 429: the queue-wait bound), that the request started
    (``started``: its first token), and that a request queued for host blocks got them
    (``reserved``)."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self.aio = aio
        self.queue: asyncio.Queue = asyncio.Queue()
        self.failed = asyncio.Event()
        self.started = asyncio.Event()
        self.reserved = asyncio.Event()
        self.refused: DecodeFull | None = None
        self._first = True

    def emit(self, kind: str, value: object) -> None:
        if kind == "error" and isinstance(value, DecodeFull):
            self.refused = value  # before ``failed`` is set, which the handler reads it after
        self.aio.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        if kind == "error":
            self.aio.call_soon_threadsafe(self.failed.set)
        elif kind == "token" and self._first:
            self._first = False
            self.aio.call_soon_threadsafe(self.started.set)

    def on_reserved(self) -> None:
        self.aio.call_soon_threadsafe(self.reserved.set)


class _Handler:
    def __init__(
        self,
        loop: DecodeLoop,
        tokenizer: Tokenizer,
        settings: AppSettings,
        metrics: Metrics,
        not_ready: Callable[[], str] = lambda: "",
    ) -> None:
        self.loop, self.tokenizer, self.settings, self.metrics = loop, tokenizer, settings, metrics
        self.not_ready = not_ready
        self.created = int(time.time())
        self.responder = Responder(tokenizer, settings.model_name)

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI model list: the served model name (--served-model-name, default the model
        directory's name), the one id this decode answers to."""
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.settings.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "kvoffload",
                        "max_model_len": self.settings.max_model_len,
                    }
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        reason = self.not_ready()
        if reason:
            return web.json_response({"status": "not_ready", "reason": reason, **self.loop.stats()}, status=503)
        return web.json_response({"status": "ok", **self.loop.stats(), "load": self.loop.load()})

    async def complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        got = await self._parse(request, chat)
        if isinstance(got, web.Response):
            return got
        parsed, ktp = got
        ids, params = parsed.prompt_ids, parsed.params
        rid = ktp.request_id or request.headers.get("X-Request-Id") or f"cmpl-{uuid.uuid4().hex}"
        bound = log.bind(request_id=rid)
        events = _Events(asyncio.get_running_loop())
        admitted = await self._admit(rid, ids, params, events)
        if isinstance(admitted, web.Response):
            return admitted
        REQUEST_IDS.link(rid, request.headers.get("X-Request-Id"))  # log lines carry the proxy's id
        bound.info(
            "request_admitted", prompt_tokens=len(ids), max_tokens=params.max_tokens, holds_blocks=admitted.reserved
        )
        done = False
        try:
            problem = await self._await_prefill(rid, ktp, bound, events, admitted.reserved)
            if problem is None:  # queued for a slot, unless it started: answer nothing before it does
                await self._started_or_failed(events)
            if events.refused is not None:  # waited past --max-queue-wait-s: 429, before any byte
                done = True
                return self._queue_timeout(bound, events.refused)
            if problem is not None:
                return problem
            out = self.responder.output(parsed.body, params, ids, admitted.sampler.logprobs.__getitem__, chat=chat)
            if parsed.stream:
                response = await self._stream(request, rid, events.queue, out, len(ids), parsed.include_usage)
            else:
                response = await self._collect(rid, events.queue, out, len(ids))
            done = True
            return response
        finally:
            if not done:
                self.loop.cancel(rid, "the client request ended early")
                self.metrics.requests.labels("cancelled").inc()
            REQUEST_IDS.unlink(rid)

    async def _started_or_failed(self, events: _Events) -> None:
        """Until the request's first token or its first error (at most ``token_timeout_s``: the
        stream or JSON answer then says no token came)."""
        waits = {asyncio.ensure_future(events.started.wait()), asyncio.ensure_future(events.failed.wait())}
        try:
            await asyncio.wait(waits, timeout=self.settings.token_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    def _queue_timeout(self, bound, refused: DecodeFull) -> web.Response:
        """The 429 of a request refused after waiting past the queue-wait bound."""
        bound.warning("request_queue_timeout", reason=str(refused), retry_after_s=refused.retry_after_s)
        self.metrics.requests.labels("queue_timeout").inc()
        return too_busy_response(str(refused), refused.retry_after_s)

    async def _parse(self, request: web.Request, chat: bool) -> tuple[ParsedRequest, KVTransferParams] | web.Response:
        """The request and its ``transfer`` (a remote prefill), or the 400 that refuses it."""
        try:
            parsed = parse_request(
                await request.read(), self.tokenizer, chat=chat, max_model_len=self.settings.max_model_len
            )
        except RequestError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        ktp = parsed.transfer
        if ktp is None or not ktp.do_remote_prefill or not ktp.metaserver:
            return error_response(
                400,
                "kv_transfer_params: this decode node serves requests with a remote prefill "
                "(do_remote_prefill and metaserver, as the proxy sends them)",
                "invalid_request_error",
            )
        return parsed, ktp

    async def _admit(self, rid: str, ids: list[int], params: SamplingParams, events: _Events):
        """The loop's ``DecodeRequest``, admitted at once (never a wait: queued, or 429 when the queue
        is full), or the error answer."""
        try:
            return await asyncio.to_thread(self.loop.expect_remote, rid, ids, params, events.emit, events.on_reserved)
        except DecodeFull as exc:
            self.metrics.rejected.inc()
            return too_busy_response(str(exc), exc.retry_after_s)
        except TooLarge as exc:
            return error_response(413, str(exc), "invalid_request_error")
        except ValueError as exc:
            return error_response(409, str(exc), "invalid_request_error")

    async def _await_prefill(
        self, rid: str, ktp: KVTransferParams, bound, events: _Events, reserved: bool
    ) -> web.Response | None:
        """Tell the proxy's metaserver where to push (once the request holds its host blocks) and wait
        for the prefill: None when the prompt's KV and first token are all here, else the error answer."""
        token, metaserver = ktp.registration_token, str(ktp.metaserver)
        if not reserved:  # host pool full: queued for blocks; lift the proxy's registration deadline
            problem = await self._wait_for_blocks(rid, metaserver, bound, events, token)
            if problem:
                return error_response(502, problem, "decode_error")
        self.loop.awaiting_prefill(rid)
        problem = await self._register_unless_failed(rid, metaserver, bound, events, token)
        if not problem:  # the prefill reported done before the metaserver answered: all KV must be here
            problem = self.loop.check_prompt_complete(rid)
        if problem:
            self.metrics.requests.labels("prefill_failed").inc()
            return error_response(502, problem, "prefill_failed")
        return None

    async def _wait_for_blocks(self, rid: str, metaserver: str, bound, events: _Events, token: str | None) -> str:
        """A request admitted while the host pool is full: tell the metaserver it is queued (the proxy
        then waits for its registration as long as the request lives), then wait for its blocks.
        No timer here: the client's disconnect (the proxy's ``--request-timeout-s``) cancels it."""
        problem = await self._register(rid, metaserver, bound, token, queued=True)
        if problem:
            return problem
        waits = {asyncio.ensure_future(events.reserved.wait()), asyncio.ensure_future(events.failed.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if events.reserved.is_set():
            return ""
        kind, value = events.queue.get_nowait()
        return str(value)

    async def _register_unless_failed(
        self, rid: str, metaserver: str, bound, events: _Events, token: str | None = None
    ) -> str:
        """``_register``, cut short when the request fails meanwhile (its prefill went quiet):
        the metaserver's answer can take the whole prefill, a dead prefill must not."""
        register = asyncio.ensure_future(self._register(rid, metaserver, bound, token))
        failure = asyncio.ensure_future(events.failed.wait())
        try:
            await asyncio.wait({register, failure}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failure.cancel()
        if register.done():
            return register.result()
        register.cancel()
        while True:  # the error the request failed with (tokens before it are dropped: it failed)
            kind, value = events.queue.get_nowait()
            if kind == "error":
                bound.warning("request_failed_while_prefilling", reason=str(value))
                return str(value)

    async def _register(self, rid: str, metaserver: str, bound, token: str | None = None, queued: bool = False) -> str:
        """POST our endpoint to the proxy's metaserver (``pdlink.registration``: the message, the
        retries); "" when it answered ok, else what failed. ``token``: the proxy's per-request
        ``metaserver_token`` (set when the proxy has an API key). ``queued``: instead, tell it the
        request is queued here (answered at once; the proxy's registration deadline no longer
        applies to it)."""
        s = self.settings
        reg = Registration(rid, metaserver, token, s.advertise_host, s.control_port, s.tp_size, s.dp_rank, queued)
        timeout = aiohttp.ClientTimeout(total=s.metaserver_timeout_s)
        attempt = 0
        while True:
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    async with session.post(metaserver, json=reg.body(), headers=reg.headers()) as resp:
                        text = await resp.text()
                        if resp.status // 100 == 2:
                            return ""
                        bound.warning("metaserver_error", status=resp.status, body=text[:500])
                        return reg.refused(resp.status, text)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                if attempt == s.metaserver_retries:
                    return reg.unreachable(attempt + 1, exc)
                await asyncio.sleep(backoff_s(attempt))
                attempt += 1

    async def _next(self, queue: asyncio.Queue) -> tuple[str, object]:
        return await asyncio.wait_for(queue.get(), timeout=self.settings.token_timeout_s)

    async def _next_or_timeout(self, queue: asyncio.Queue) -> tuple[str, object]:
        try:
            return await self._next(queue)
        except asyncio.TimeoutError:
            return "timeout", f"no token for {self.settings.token_timeout_s} s"

    async def _stream(
        self, request: web.Request, rid: str, queue, out: Output, n_prompt: int, include_usage: bool
    ) -> web.StreamResponse:
        """SSE chunks (openai_api.output); an error ends the stream with an error event."""

        async def next_event() -> tuple[str, object]:
            kind, value = await self._next_or_timeout(queue)
            return ("error", value) if kind == "timeout" else (kind, value)

        def on_error(message: str) -> None:
            self.metrics.requests.labels("error").inc()
            self.loop.cancel(rid, message)

        return await sse_response(
            request,
            rid,
            self.responder.events(
                rid,
                next_event,
                out,
                n_prompt,
                include_usage,
                on_error,
                lambda: self.metrics.requests.labels("ok").inc(),
            ),
        )

    async def _collect(self, rid: str, queue, out: Output, n_prompt: int) -> web.Response:
        timed_out = []

        async def next_event() -> tuple[str, object]:
            kind, value = await self._next_or_timeout(queue)
            if kind == "timeout":
                timed_out.append(value)
                return "error", value
            return kind, value

        obj, error = await self.responder.collect(rid, next_event, out, n_prompt)
        if obj is None:
            if timed_out:
                self.loop.cancel(rid, "token timeout")
                return error_response(504, error, "timeout")
            self.metrics.requests.labels("error").inc()
            return error_response(500, error, "decode_error")
        self.metrics.requests.labels("ok").inc()
        return web.json_response(obj, headers={"X-Request-Id": rid})
