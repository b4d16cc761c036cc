"""One client request through the layerwise P/D flow ("decode first").

    open the rendezvous -> send every child to a decoder -> (each decoder registers at
    /v1/metaserver; the last one triggers one batched prefill) -> relay decoder output -> close.

The client's handler task owns everything a request holds (rendezvous, decoder leases and
connections, the prefiller lease) and releases it in one `finally:`; a client disconnect cancels
that task, so it also cancels the decoder requests and a pending prefill. Every wait is bounded
(see `upstream` and `metaserver`), and `Flow.run` adds a backstop on the gap between events.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from openai_api.sampling_params import choice_seed
from openai_api.transfer_params import KVTransferParams

from . import upstream
from .auth import MetaserverTokens
from .balancer import Balancer, Lease
from .config import ProxyConfig
from .errors import ProxyError
from .metaserver import Registry, Rendezvous
from .metrics import ProxyMetrics
from .relay import JsonRelay, StreamRelay
from .schemas import InferenceRequest

log = structlog.get_logger("kvoffload_proxy.flow")
_CHILD_DONE = object()


def decoder_body(
    req: InferenceRequest, index: int, child_id: str, metaserver_url: str, metaserver_token: str | None = None
) -> dict:
    """Child `index` = choice `index % n` of prompt `index // n`: one choice per decoder request,
    with the choice's derived seed (the prefill derives the same for the first token)."""
    body = dict(req.body)
    if req.is_batch:
        body["prompt"] = req.prompts[index]
    if req.n > 1:
        body.pop("best_of", None)  # == n, checked at the edge
        body.update(n=1, seed=choice_seed(body.get("seed") or 0, index % req.n))
    # with --api-key: metaserver_token is the decoder's bearer token for /v1/metaserver
    params: dict[str, object] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "metaserver": metaserver_url,
        "request_id": child_id,
    }
    if metaserver_token is not None:  # only the fields set go on the wire
        params["metaserver_token"] = metaserver_token
    body["kv_transfer_params"] = KVTransferParams.model_validate(params).wire()
    return body


def prefill_body(req: InferenceRequest, params: list[KVTransferParams]) -> dict:
    """The client's original request, reduced to one prefill step, carrying the decoders' params
    (one per child, in child order, when there is more than one prompt or choice). The client's
    sampling parameters stay: the prefill samples the first token with them (min_tokens included)."""
    body = dict(req.body)
    body.update(stream=False, max_tokens=1)
    body.pop("stream_options", None)
    body.pop("max_completion_tokens", None)
    if req.is_batch or req.n > 1:
        body["kv_transfer_params_list"] = [p.wire() for p in params]
    else:
        body["kv_transfer_params"] = params[0].wire()
    return body


@dataclass
class RequestState:
    req: InferenceRequest
    request_id: str  # X-Request-Id, forwarded to every backend
    response_id: str  # the id clients see; children are <response_id>-<i> for prompt lists
    prefill_lease: Lease | None = None
    children_with_output: set[int] = field(default_factory=set)
    outcome: str = "ok"

    @property
    def child_ids(self) -> tuple[str, ...]:
        if not self.req.is_batch and self.req.n == 1:
            return (self.response_id,)
        return tuple(f"{self.response_id}-{i}" for i in range(self.req.num_children))

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id}


def new_state(req: InferenceRequest, client_request_id: str | None) -> RequestState:
    prefix = "cmpl" if req.kind == "completions" else "chatcmpl"
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    return RequestState(req, client_request_id or response_id, response_id)


class Flow:
    def __init__(self, cfg: ProxyConfig, prefillers: Balancer, decoders: Balancer, metrics: ProxyMetrics):
        self.cfg = cfg
        self.prefillers = prefillers
        self.decoders = decoders
        self.metrics = metrics
        self.tokens = MetaserverTokens(enabled=cfg.api_key is not None)
        connect_budget = sum(cfg.connect_timeout_s + cfg.retry_backoff_s * 2**a for a in range(cfg.max_retries + 1))
        self.max_silence_s = cfg.request_timeout_s + connect_budget + 1.0
        self.registry = Registry(
            self.dispatch_prefill,
            registration_timeout_s=cfg.metaserver_timeout_s,
            dispatch_timeout_s=self.max_silence_s,
        )
        self._session: aiohttp.ClientSession | None = None
        self.draining = False
        self._inflight: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=upstream.KEEPALIVE_S), auto_decompress=True
        )

    async def close(self) -> None:
        await self.registry.aclose()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        """The backends' HTTP session: it exists from `start` on (the app's startup)."""
        if self._session is None:
            raise RuntimeError("the proxy's client session is not open: Flow.start() has not run")
        return self._session

    def _retried(self, backend) -> None:
        self.metrics.retries.labels(backend.role, backend.url).inc()

    # -- prefill (run by the registry once every child registered) ---------------------------
    async def dispatch_prefill(self, rdv: Rendezvous) -> None:
        st: RequestState = rdv.context
        num_tokens = sum(st.req.num_prompt_tokens)
        start = time.monotonic()
        lease, resp = await upstream.post(
            self.session,
            self.prefillers,
            self.cfg,
            st.req.path,
            prefill_body(st.req, rdv.ordered_params()),
            headers=st.headers,
            num_tokens=num_tokens,
            num_kv_tokens=num_tokens,
            on_retry=self._retried,
        )
        st.prefill_lease = lease
        try:
            async with upstream.owned(resp):
                if resp.status >= 300:
                    raise await upstream.http_error(resp, lease.backend)
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise upstream.transport_error(e, lease.backend, "running the prefill") from None
        finally:
            lease.release_tokens()
            if rdv.closed:  # the request was answered before its prefill: nobody else releases it
                lease.release()
        log.info(
            "prefill_done",
            prefiller=lease.backend.url,
            parent_id=rdv.parent_id,
            children=len(rdv.child_ids),
            ms=round((time.monotonic() - start) * 1000, 1),
        )

    # -- decoders --------------------------------------------------------------------------
    async def _run_child(self, st: RequestState, i: int, out: asyncio.Queue) -> None:
        req = st.req
        body = decoder_body(
            req, i, st.child_ids[i], self.cfg.advertised_metaserver_url, self.tokens.issue(st.child_ids[i])
        )
        try:
            lease, resp = await upstream.post(
                self.session,
                self.decoders,
                self.cfg,
                req.path,
                body,
                headers=st.headers,
                num_tokens=req.num_prompt_tokens[i] + req.max_tokens,
                on_retry=self._retried,
            )
        except ProxyError as e:  # no decoder took it (nothing is held)
            out.put_nowait((i, e))
            return
        backend = lease.backend
        try:
            log.info("decoder_dispatched", decoder=backend.url, child_id=st.child_ids[i])
            async with upstream.owned(resp):
                if resp.status >= 300:
                    raise await upstream.http_error(resp, backend)
                if req.stream:
                    async for data in upstream.sse_data(resp):
                        if data.strip() == "[DONE]":
                            break
                        out.put_nowait((i, _parse_output(data, backend)))
                    else:
                        raise ProxyError(
                            502,
                            f"decoder {backend.url} closed the stream before [DONE]",
                            backend=backend.url,
                            role="decoder",
                        )
                else:
                    out.put_nowait((i, _parse_output(await resp.text(), backend)))
            out.put_nowait((i, _CHILD_DONE))
        except ProxyError as e:
            out.put_nowait((i, e))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            out.put_nowait((i, upstream.transport_error(e, backend, "relaying the response")))
        finally:
            lease.release()

    def _note_output(self, st: RequestState, i: int) -> None:
        """Once every child produced output its decoder pulled all layers: the prefiller's KV
        load is gone."""
        st.children_with_output.add(i)
        if len(st.children_with_output) == st.req.num_children and st.prefill_lease:
            st.prefill_lease.release()

    async def _relay_children(self, st: RequestState, out: asyncio.Queue, relay: StreamRelay | JsonRelay) -> None:
        """Relay the children's output as it arrives until every child finished; a child's error
        (or the rendezvous's), or no event for `max_silence_s`, raises `ProxyError`."""
        pending = set(range(st.req.num_children))
        while pending:
            try:
                i, item = await asyncio.wait_for(out.get(), self.max_silence_s)
            except asyncio.TimeoutError:
                raise ProxyError(504, f"no output for {self.max_silence_s:g}s") from None
            if isinstance(item, ProxyError):
                raise item
            if item is _CHILD_DONE:
                pending.discard(i)
                continue
            self._note_output(st, i)
            await relay.add(i, item)

    # -- the request ------------------------------------------------------------------------
    async def run(self, request: web.Request, st: RequestState) -> web.StreamResponse:
        if self.draining:
            raise ProxyError(503, "the proxy is shutting down; retry on another instance")
        task = asyncio.current_task()
        assert task is not None  # awaited by the client's handler task
        self._inflight.add(task)
        self._idle.clear()
        req = st.req
        out: asyncio.Queue = asyncio.Queue()
        try:
            rdv = self.registry.open(st.response_id, st.child_ids, st)
        except BaseException:
            self._finished(task)  # never left counted as in flight: a drain would wait for it
            raise

        def fail_children(outcome: asyncio.Future) -> None:  # the rendezvous failed: so does every child
            if outcome.exception() is not None:
                out.put_nowait((None, outcome.exception()))

        rdv.outcome.add_done_callback(fail_children)
        relay = (
            StreamRelay(request, st.response_id, st.headers, req.n, self.max_silence_s)
            if req.stream
            else JsonRelay(st.response_id, st.headers, req.n)
        )
        children = [asyncio.create_task(self._run_child(st, i, out)) for i in range(req.num_children)]
        answered = False
        try:
            await self._relay_children(st, out, relay)
            answered = True
            return await relay.finish()
        except ProxyError as e:
            st.outcome = e.outcome
            if e.status == 429:
                self.metrics.rejected.inc()
            log.warning("request_failed", status=e.status, error=e.message, backend=e.backend)
            return await relay.fail(e)
        except (ConnectionResetError, asyncio.TimeoutError):  # client gone or not reading
            st.outcome = "cancelled"
            log.info("client_disconnected_or_stalled")
            return relay.response or web.Response(status=499)
        except asyncio.CancelledError:
            st.outcome = "cancelled"
            if self.draining:
                await relay.abort(ProxyError(503, "the proxy shut down before this request ended"))
            log.info("request_cancelled", draining=self.draining)
            raise
        finally:
            for t in children:
                t.cancel()
            self.registry.close(rdv, answered=answered)
            try:
                if children:
                    await asyncio.wait(children, timeout=5)
            finally:  # a second cancel (a drain, the client leaving) lands here: still accounted
                if st.prefill_lease is not None:
                    st.prefill_lease.release()
                self._finished(task)

    @property
    def in_flight(self) -> int:
        """Client requests between admission and their last accounting step (0 when idle)."""
        return len(self._inflight)

    def _finished(self, task: asyncio.Task) -> None:
        self._inflight.discard(task)
        if not self._inflight:
            self._idle.set()

    async def drain(self, grace_s: float) -> None:
        """Stop admitting requests, let in-flight ones finish for `grace_s`, then cancel them."""
        self.draining = True
        log.info("draining_requests", in_flight=len(self._inflight))
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except asyncio.TimeoutError:
            log.warning("shutdown_cancelling", requests=len(self._inflight))
            for t in list(self._inflight):
                t.cancel()
            try:
                await asyncio.wait_for(self._idle.wait(), 5)
            except asyncio.TimeoutError:
                pass


def _parse_output(data: str, backend) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise ProxyError(
            502,
            f"decoder {backend.url} sent output that is not a JSON object: {data[:200]!r}",
            backend=backend.url,
            role="decoder",
        )
    if "error" in obj or obj.get("object") == "error":
        err = obj.get("error", obj)
        code = err.get("code") if isinstance(err, dict) else None
        status = code if isinstance(code, int) and 400 <= code < 500 else 502
        msg = err.get("message") if isinstance(err, dict) else str(err)
        raise ProxyError(
            status,
            f"decoder {backend.url} reported an error: {msg}",
            backend=backend.url,
            role="decoder",
            relay_body=obj if status < 500 else None,
        )
    return obj
