"""HTTP routes of the proxy (thin: parse, call the flow / registry / probes, answer).

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (the decoders' models, see
models.py), POST /v1/metaserver, GET /healthcheck, POST /reset_prefix_cache, GET /metrics,
GET /openapi.json. Middlewares, outermost first:
request id (honour or assign X-Request-Id, bind it to every log line, count outcomes), errors
(every non-2xx is an OpenAI-style JSON error), API key (Bearer; see auth.py: /healthcheck and
/openapi.json are open, /v1/metaserver takes the per-request token the proxy gave the decoder).
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid

import structlog
from aiohttp import web

from openai_api.transfer_params import KVTransferParams

from . import upstream
from .auth import bearer, matches
from .balancer import Balancer
from .config import ProxyConfig
from .errors import ProxyError
from .flow import Flow, RequestState, new_state
from .metrics import CONTENT_TYPE, ProxyMetrics
from .models import ModelCatalog
from .openapi import REQUEST_ID_PATTERN, build_openapi
from .relay import error_response
from .schemas import InferenceKind, MetaserverRegistration, load_json_object, parse_inference, validate

log = structlog.get_logger("kvoffload_proxy.app")
CONFIG = web.AppKey("config", ProxyConfig)
FLOW = web.AppKey("flow", Flow)
METRICS = web.AppKey("metrics", ProxyMetrics)
MODELS = web.AppKey("models", ModelCatalog)
OPENAPI = web.AppKey("openapi", dict)
_request_key = getattr(web, "RequestKey", lambda name, t: name)  # typed keys since aiohttp 3.13
REQUEST_ID = _request_key("request_id", str)
STATE = _request_key("state", RequestState)
INFERENCE_PATHS: dict[str, InferenceKind] = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
AUTH_EXEMPT = {"/healthcheck", "/openapi.json"}  # open to load balancers and API tooling
METASERVER = "/v1/metaserver"  # decoders authenticate with their request's token, checked in `metaserver`
_UNAUTHORIZED = "missing or invalid API key (send 'Authorization: Bearer KEY')"
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


def _outcome(request: web.Request, resp: web.StreamResponse | None) -> str:
    if resp is None:
        return "cancelled"
    st = request.get(STATE)
    if st is not None and st.outcome != "ok":
        return st.outcome  # e.g. a stream that failed after its 200
    return "ok" if resp.status < 400 else ProxyError(resp.status, "").outcome


@web.middleware
async def request_context(request: web.Request, handler):
    rid = request.headers.get("X-Request-Id")
    bad_rid = rid is not None and not _REQUEST_ID.match(rid)
    request[REQUEST_ID] = rid = (None if bad_rid else rid) or uuid.uuid4().hex
    endpoint = INFERENCE_PATHS.get(request.path) if request.method == "POST" else None
    resp = None
    with structlog.contextvars.bound_contextvars(request_id=rid):
        try:
            if bad_rid:
                raise ProxyError(
                    400, "header X-Request-Id must be 1-128 visible ASCII characters", param="X-Request-Id"
                )
            resp = await handler(request)
        except ProxyError as e:
            resp = error_response(e)
        finally:
            if endpoint is not None:
                request.app[METRICS].requests.labels(endpoint, _outcome(request, resp)).inc()
    if not resp.prepared:
        resp.headers.setdefault("X-Request-Id", rid)
    return resp


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except ProxyError:
        raise
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = (
            e.reason
            if e.status != 413
            else (f"request body larger than --max-request-bytes ({request.app[CONFIG].max_request_bytes} bytes)")
        )
        kept = {k: v for k, v in e.headers.items() if k in ("Allow",)}
        raise ProxyError(e.status, message, headers=kept) from None
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("unhandled_error")
        raise ProxyError(500, f"internal proxy error: {type(e).__name__}") from None


def unauthorized(message: str = _UNAUTHORIZED) -> ProxyError:
    return ProxyError(401, message, headers={"WWW-Authenticate": 'Bearer realm="kvoffload"'})


def authenticated(request: web.Request) -> bool:
    """True when no key is set or the request carries it."""
    key = request.app[CONFIG].api_key
    return key is None or matches(bearer(request.headers), key)


@web.middleware
async def api_key(request: web.Request, handler):
    cfg = request.app[CONFIG]
    if cfg.api_key is not None and request.path not in AUTH_EXEMPT:
        if request.path == METASERVER:  # the token is bound to the body's request_id: `metaserver` checks it
            if bearer(request.headers) is None:
                raise unauthorized(
                    "missing metaserver token (send 'Authorization: Bearer TOKEN' with the "
                    "kv_transfer_params.metaserver_token the proxy gave this request)"
                )
        elif not authenticated(request):
            raise unauthorized()
    return await handler(request)


async def inference(request: web.Request) -> web.StreamResponse:
    req = parse_inference(INFERENCE_PATHS[request.path], await request.read())
    st = new_state(req, request[REQUEST_ID])
    request[STATE] = st
    with structlog.contextvars.bound_contextvars(response_id=st.response_id):
        log.info("request_start", kind=req.kind, children=req.num_children, stream=req.stream)
        return await request.app[FLOW].run(request, st)


async def models(request: web.Request) -> web.Response:
    data = await request.app[MODELS].models(request.app[FLOW].session, {"X-Request-Id": request[REQUEST_ID]})
    return web.json_response({"object": "list", "data": data})


async def metaserver(request: web.Request) -> web.Response:
    start, flow = time.monotonic(), request.app[FLOW]
    data = load_json_object(await request.read())
    reg = validate(MetaserverRegistration, data)
    if not flow.tokens.check(bearer(request.headers), reg.request_id):  # before any lookup: no oracle
        raise unauthorized(f"invalid metaserver token for request_id {reg.request_id!r}")
    params = reg.kv_transfer_params if reg.kv_transfer_params is not None else validate(KVTransferParams, data)
    rdv = flow.registry.lookup(reg.request_id)
    parent_rid = rdv.context.request_id if rdv is not None else request[REQUEST_ID]
    outcome = "ok"
    with structlog.contextvars.bound_contextvars(request_id=parent_rid, child_id=reg.request_id):
        try:
            await flow.registry.register(reg.request_id, params)
        except (ProxyError, asyncio.TimeoutError) as e:
            if not isinstance(e, ProxyError):
                e = ProxyError(504, "prefill outcome not known in time", role="prefiller")
            outcome = e.outcome
            status = 502 if e.relay_body is not None else e.status
            body = {"status": "error", "request_id": reg.request_id, "error": e.error_object()}
            if e.role == "prefiller" and e.backend:
                body["prefiller"] = e.backend
            log.warning("metaserver_error", status=status, error=e.message, prefiller=e.backend)
            return web.json_response(body, status=status)
        finally:
            flow.metrics.metaserver_latency.labels(outcome).observe(time.monotonic() - start)
        log.info("metaserver_ok", ms=round((time.monotonic() - start) * 1000, 1))
        return web.json_response({"status": "ok"})


async def healthcheck(request: web.Request) -> web.Response:
    cfg, flow = request.app[CONFIG], request.app[FLOW]
    if flow.draining:
        return web.json_response({"status": "shutting_down", "backends": []}, status=503)
    results = await asyncio.gather(
        *(upstream.probe(flow.session, b, "GET", "/health", cfg.health_timeout_s) for b in cfg.backends)
    )
    ok = all(r["ok"] for r in results)
    body: dict[str, object] = {"status": "ok" if ok else "unhealthy"}
    if authenticated(request):  # with --api-key, anonymous probes get the status, not the topology
        body["backends"] = results
    return web.json_response(body, status=200 if ok else 503)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    cfg, flow = request.app[CONFIG], request.app[FLOW]
    timeout_s = min(cfg.request_timeout_s, 60.0)
    results = await asyncio.gather(
        *(upstream.probe(flow.session, b, "POST", "/reset_prefix_cache", timeout_s) for b in cfg.backends)
    )
    ok = all(r["ok"] for r in results)
    return web.json_response(
        {"status": "ok" if ok else "partial_failure", "backends": results}, status=200 if ok else 502
    )


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


def create_app(cfg: ProxyConfig) -> web.Application:
    prefillers = Balancer(cfg.prefillers, kv_weight=cfg.prefill_kv_weight)
    decoders = Balancer(cfg.decoders)
    app = web.Application(client_max_size=cfg.max_request_bytes, middlewares=[request_context, errors_as_json, api_key])

    def registry_size() -> int:
        return len(app[FLOW].registry)

    app_metrics = ProxyMetrics([prefillers, decoders], registry_size)
    app[CONFIG] = cfg
    app[METRICS] = app_metrics
    app[FLOW] = Flow(cfg, prefillers, decoders, app_metrics)
    app[MODELS] = ModelCatalog(cfg.decoders, timeout_s=cfg.health_timeout_s)
    app[OPENAPI] = build_openapi(api_key_required=cfg.api_key is not None)

    async def client_session(app: web.Application):
        await app[FLOW].start()
        yield
        await app[FLOW].close()

    app.cleanup_ctx.append(client_session)
    app.router.add_post("/v1/completions", inference)
    app.router.add_post("/v1/chat/completions", inference)
    app.router.add_get("/v1/models", models, allow_head=False)
    app.router.add_post("/v1/metaserver", metaserver)
    app.router.add_get("/healthcheck", healthcheck, allow_head=False)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/metrics", metrics, allow_head=False)
    app.router.add_get("/openapi.json", openapi, allow_head=False)
    return app
