"""The prefill's HTTP API: the proxy's ``max_tokens=1`` dispatch on ``/v1/completions`` and
``/v1/chat/completions`` (one prompt with ``kv_transfer_params``, or a prompt list with
``kv_transfer_params_list``), plus ``/health``, ``/metrics`` and ``/reset_prefix_cache``.

Every child request takes a turn of the worker's queue (``kvoffload_prefill.queue_bound``) before it
reaches a thread: one the queue refuses, at admission or after waiting past the bound, is answered
429 with ``Retry-After`` (when the queue's estimate would admit it) before any byte, as the whole
request."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import structlog
from aiohttp import web

from kvoffload_prefill.metrics import PrefillMetrics
from kvoffload_prefill.queue_bound import MAX_IN_SERVICE, PrefillBusy
from kvoffload_prefill.worker import PrefillOutcome, PrefillWorker
from openai_api.body import RequestError
from openai_api.dispatch import Child, parse_dispatch
from openai_api.logprobs import chat_logprobs, completion_logprobs
from openai_api.tokenizer import Tokenizer
from svcruntime.logs import REQUEST_IDS
from svcruntime.serving import draining_app, error_response, too_busy_response

log = structlog.get_logger(__name__)


class Metrics(PrefillMetrics):
    def __init__(self, worker: PrefillWorker) -> None:
        super().__init__(worker.engine.pool)
        self.worker = worker
        self.gate_wait = self.gauge("kvoffload_prefill_gate_wait_seconds_total", "Time spent waiting on reuse gates")
        self.held = self.gauge("kvoffload_prefill_held_slots", "Slots whose occupant is not settled")
        self.read_ms = self.gauge("kvoffload_prefill_read_done_ms_avg", "Average announce -> READ_DONE latency (ms)")
        self.queued = self.gauge("kvoffload_prefill_queued_requests", "Requests waiting for the engine")
        self.queued_tokens = self.gauge(
            "kvoffload_prefill_queued_prompt_tokens", "Prompt tokens waiting for the engine"
        )
        self.rate = self.gauge(
            "kvoffload_prefill_prompt_tokens_per_second", "The engine's measured rate (0 before the first run)"
        )

    def update(self) -> None:
        gates = self.worker.engine.gates.stats()
        self.gate_wait.set(gates["total_wait_s"])
        self.held.set(gates["held_slots"])
        lat = self.worker.read_latency_ms()
        self.read_ms.set(sum(lat) / len(lat) if lat else 0.0)
        queue = self.worker.queue.stats()
        self.queued.set(queue["queued"])
        self.queued_tokens.set(queue["queued_tokens"])
        self.rate.set(queue["rate_tokens_per_s"])


def build_app(
    worker: PrefillWorker,
    tokenizer: Tokenizer,
    model_name: str,
    max_model_len: int,
    not_ready: Callable[[], str] = lambda: "",
) -> web.Application:
    """The HTTP API; ``not_ready()`` says why the prefill cannot take requests now ("" when it can),
    e.g. its pool is not registered with the metastore: ``/health`` then answers 503 with the reason."""
    metrics = Metrics(worker)
    app = draining_app("prefill")
    dispatch = _Dispatch(worker, tokenizer, model_name, max_model_len, metrics)

    async def stop_threads(app: web.Application) -> None:
        dispatch.executor.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_threads)

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **await asyncio.to_thread(worker.reset_prefix_cache)})

    async def health(request: web.Request) -> web.Response:
        reason = not_ready()
        if reason:
            return web.json_response(
                {"status": "not_ready", "reason": reason, **worker.engine.gates.stats()}, status=503
            )
        return web.json_response({"status": "ok", **worker.engine.gates.stats()})

    app.router.add_post("/v1/completions", lambda r: dispatch.complete(r, False))
    app.router.add_post("/v1/chat/completions", lambda r: dispatch.complete(r, True))
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics.handle)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app


class _Dispatch:
    """The proxy's dispatch: one prompt or a prompt list, ``n`` choices each; every (prompt, choice)
    is a child request, prefilled in turn, and answers with its first token."""

    def __init__(
        self, worker: PrefillWorker, tokenizer: Tokenizer, model_name: str, max_model_len: int, metrics: Metrics
    ) -> None:
        self.worker, self.tokenizer, self.metrics = worker, tokenizer, metrics
        self.model_name, self.max_model_len = model_name, max_model_len
        # a thread for every request in service: one waiting for its turn never delays another's
        self.executor = ThreadPoolExecutor(MAX_IN_SERVICE, thread_name_prefix="prefill-request")

    async def complete(self, request: web.Request, chat: bool) -> web.Response:
        try:
            children = parse_dispatch(await request.read(), self.tokenizer, chat=chat, max_model_len=self.max_model_len)
        except RequestError as exc:
            return error_response(400, str(exc), "invalid_request_error")
        rid = request.headers.get("X-Request-Id") or f"cmpl-{uuid.uuid4().hex}"
        choices, usage = [], 0
        for i, child in enumerate(children):
            out = await self._prefill(rid, f"{rid}-{i}" if len(children) > 1 else rid, child)
            if isinstance(out, web.Response):
                return out
            choices.append(self._choice(i, out, chat))
            usage += out.num_prompt_tokens
        self.metrics.requests.labels("ok").inc()
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": usage,
                    "completion_tokens": len(choices),
                    "total_tokens": usage + len(choices),
                },
            },
            headers={"X-Request-Id": rid},
        )

    async def _prefill(self, rid: str, child_id: str, child: Child):
        """The child's ``PrefillOutcome``, or the error answer of the whole request."""
        try:
            turn = self.worker.queue.admit(child_id, len(child.prompt_ids))
        except PrefillBusy as exc:
            return self._too_busy(rid, exc)
        wire_id = (child.transfer.request_id or "") if child.transfer is not None else ""
        REQUEST_IDS.link(wire_id, rid)  # log lines about the wire id carry the proxy's id
        try:
            # the worker's thread owns the turn from here: it leaves the queue when the run ends
            run = partial(self.worker.run, child_id, child.prompt_ids, child.transfer, child.params, turn=turn)
            return await asyncio.get_running_loop().run_in_executor(self.executor, run)
        except PrefillBusy as exc:
            return self._too_busy(rid, exc)
        except ValueError as exc:
            self.metrics.requests.labels("bad_request").inc()
            return error_response(400, str(exc), "invalid_request_error")
        except Exception as exc:  # noqa: BLE001 - any failure of one prefill is its request's 502; the server serves on
            self.metrics.requests.labels("error").inc()
            log.error("prefill_failed", request_id=rid, error=repr(exc))
            return error_response(502, f"prefill failed: {exc}", "prefill_failed")
        finally:
            REQUEST_IDS.unlink(wire_id)

    def _too_busy(self, rid: str, refused: PrefillBusy) -> web.Response:
        """The 429 of a refused request, counted and logged."""
        self.metrics.requests.labels("too_busy").inc()
        log.warning("prefill_refused", request_id=rid, reason=str(refused), retry_after_s=refused.retry_after_s)
        return too_busy_response(str(refused), refused.retry_after_s)

    def _choice(self, index: int, out: PrefillOutcome, chat: bool) -> dict:
        """The child's choice: its first token (and its log-probabilities when asked for)."""
        text = self.tokenizer.decode([out.first_token], skip_special_tokens=True)
        lps = [out.first_logprob] if out.first_logprob is not None else None
        logprobs = (
            None
            if lps is None
            else chat_logprobs(self.tokenizer, lps)
            if chat
            else completion_logprobs(self.tokenizer, lps, [0])
        )
        choice = {"index": index, "token_ids": [out.first_token], "finish_reason": "length", "logprobs": logprobs}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return choice
