"""The prefill's HTTP API: the proxy's ``max_tokens=1`` dispatch on ``/v1/completions`` and
``/v1/chat/completions`` (one prompt with ``kv_transfer_params``, or a prompt list with
``kv_transfer_params_list``), plus ``/health``, ``/metrics`` and ``/reset_prefix_cache``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable

import structlog
from aiohttp import web
from dsamodel.openai import (RequestError, chat_logprobs, check_body, completion_logprobs, prompt_ids,
                             sampling_params)
from dsamodel.tokenizer import ByteTokenizer
from svcruntime.logs import REQUEST_IDS
from svcruntime.serving import DRAINING, refuse_while_draining
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from kvoffload_prefill.worker import PrefillWorker

log = structlog.get_logger(__name__)


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": code, "code": status}}, status=status)


class Metrics:
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker
        self.registry = CollectorRegistry()
        self.requests = Counter("kvoffload_prefill_requests", "Requests by outcome", ["outcome"], registry=self.registry)
        self.gate_wait = Gauge("kvoffload_prefill_gate_wait_seconds_total", "Time spent waiting on reuse gates",
                               registry=self.registry)
        self.held = Gauge("kvoffload_prefill_held_slots", "Slots whose occupant is not settled", registry=self.registry)
        self.read_ms = Gauge("kvoffload_prefill_read_done_ms_avg", "Average announce -> READ_DONE latency (ms)",
                             registry=self.registry)
        self.pool_used = Gauge("kvoffload_prefill_pool_used_bytes", "Host-pool bytes in use", registry=self.registry)

    def render(self) -> bytes:
        eng = self.worker.engine
        gates = eng.gates.stats()
        self.gate_wait.set(gates["total_wait_s"])
        self.held.set(gates["held_slots"])
        lat = self.worker.read_latency_ms()
        self.read_ms.set(sum(lat) / len(lat) if lat else 0.0)
        self.pool_used.set(eng.pool.stats().used_bytes)
        return generate_latest(self.registry)


def build_app(worker: PrefillWorker, tokenizer: ByteTokenizer, model_name: str, max_model_len: int,
              not_ready: Callable[[], str] = lambda: "") -> web.Application:
    """The HTTP API; ``not_ready()`` says why the prefill cannot take requests now ("" when it can),
    e.g. its pool is not registered with the metastore: ``/health`` then answers 503 with the reason."""
    metrics = Metrics(worker)
    app = web.Application(client_max_size=32 << 20, middlewares=[refuse_while_draining("prefill")])
    app[DRAINING] = asyncio.Event()

    async def complete(request: web.Request, chat: bool) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise RequestError("body: must be a JSON object")
            check_body(body, chat=chat, max_n=None)
            n = int(body.get("n") or 1)
            # choice j of n samples its first token with the seed the proxy gives that choice's decode
            choice_params = [sampling_params(body, chat=chat, choice=j, first_token_only=True) for j in range(n)]
            prompts = body.get("prompt") if not chat else None
            if isinstance(prompts, list) and prompts and all(isinstance(p, (str, list)) for p in prompts) \
                    and not all(isinstance(p, int) for p in prompts):
                prompt_list = [prompt_ids({"prompt": p}, tokenizer, chat=False) for p in prompts]
            else:
                prompt_list = [prompt_ids(body, tokenizer, chat=chat)]
            # one child per (prompt, choice), in the proxy's order: child = prompt * n + choice
            ids_list = [ids for ids in prompt_list for _ in range(n)]
            sampling = [choice_params[j] for _ in prompt_list for j in range(n)]
            if len(ids_list) > 1 or body.get("kv_transfer_params_list") is not None:
                params_list = body.get("kv_transfer_params_list") or [None] * len(ids_list)
                if not isinstance(params_list, list) or len(params_list) != len(ids_list):
                    raise RequestError("kv_transfer_params_list: must give one entry per prompt and choice "
                                       f"({len(ids_list)})")
            else:
                params_list = [body.get("kv_transfer_params")]
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "body: malformed JSON", "invalid_request_error")
        except RequestError as exc:
            return _error(400, str(exc), "invalid_request_error")
        for ids in ids_list:
            if len(ids) > max_model_len:
                return _error(400, f"prompt of {len(ids)} tokens exceeds max_model_len={max_model_len}",
                              "invalid_request_error")
        rid = request.headers.get("X-Request-Id") or f"cmpl-{uuid.uuid4().hex}"
        choices, usage = [], 0
        for i, (ids, ktp, params) in enumerate(zip(ids_list, params_list, sampling)):
            wire_id = str((ktp or {}).get("request_id") or "") if isinstance(ktp, dict) else ""
            REQUEST_IDS.link(wire_id, rid)  # log lines about the wire id carry the proxy's id
            try:
                out = await asyncio.to_thread(worker.run, f"{rid}-{i}" if len(ids_list) > 1 else rid, ids, ktp, params)
            except ValueError as exc:
                metrics.requests.labels("bad_request").inc()
                return _error(400, str(exc), "invalid_request_error")
            except Exception as exc:
                metrics.requests.labels("error").inc()
                log.error("prefill_failed", request_id=rid, error=repr(exc))
                return _error(502, f"prefill failed: {exc}", "prefill_failed")
            finally:
                REQUEST_IDS.unlink(wire_id)
            text = tokenizer.decode([out.first_token], skip_special_tokens=True)
            lps = [out.first_logprob] if out.first_logprob is not None else None
            logprobs = None if lps is None else chat_logprobs(tokenizer, lps) if chat \
                else completion_logprobs(tokenizer, lps, [0])
            choice = {"index": i, "token_ids": [out.first_token], "finish_reason": "length", "logprobs": logprobs}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            choices.append(choice)
            usage += out.num_prompt_tokens
        metrics.requests.labels("ok").inc()
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_name, "choices": choices,
            "usage": {"prompt_tokens": usage, "completion_tokens": len(choices), "total_tokens": usage + len(choices)},
        }, headers={"X-Request-Id": rid})

    async def reset_prefix_cache(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **await asyncio.to_thread(worker.reset_prefix_cache)})

    app.router.add_post("/v1/completions", lambda r: complete(r, False))
    app.router.add_post("/v1/chat/completions", lambda r: complete(r, True))
    async def health(request: web.Request) -> web.Response:
        reason = not_ready()
        if reason:
            return web.json_response({"status": "not_ready", "reason": reason, **worker.engine.gates.stats()},
                                     status=503)
        return web.json_response({"status": "ok", **worker.engine.gates.stats()})

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", lambda r: web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}))
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app
