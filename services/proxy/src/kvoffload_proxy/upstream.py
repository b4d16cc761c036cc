"""Talking to backends: connect with bounded retries, map every failure to a `ProxyError`.

Retry policy (issue 6): only a failure to *deliver* the request is retried (nothing reached the
backend, so a resend cannot duplicate work): a failed connect, or a connection reset under the
request's write (``undelivered``: a pooled keep-alive connection the backend closed while it was
idle), with exponential backoff `retry_backoff_s x 2^attempt`, at most `max_retries` times,
preferring a backend not tried yet. An HTTP error answer is a failure, never retried. Idle
connections are kept ``KEEPALIVE_S``, less than the servers behind the proxy keep theirs (uvicorn's,
vLLM's: 5 s), so a reused one is rarely one the backend just closed. Timeouts: `connect_timeout_s`
per connection attempt, `request_timeout_s` for any silence while reading (headers, body or the gap
between two stream events).

Backpressure: a backend that answers 429 (a decoder whose queue is full, or, later, one that held
the request past its ``--max-queue-wait-s`` and freed it; a prefill whose queue for its engine would
hold it, or did hold it, past its own ``--max-queue-wait-s``) serves it no more, so the
request goes at once to the next backend not tried yet — those not known to be full first — and
only when every one refused does the caller get 429 with the smallest ``Retry-After`` they gave
(the last one's OpenAI-style body). Every decoder answer's ``X-Decode-Load`` header updates the
balancer (queue depth, free pool bytes).

Status given to the caller: unreachable after retries 503, timed out 504, any other transport
failure or a backend 5xx 502; a backend 4xx is relayed as it was (status and JSON body).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import structlog

from .balancer import Balancer, Lease, parse_load
from .config import Backend, ProxyConfig
from .errors import ProxyError, excerpt

log = structlog.get_logger("kvoffload_proxy.upstream")
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
KEEPALIVE_S = 3.0  # idle connections to backends are closed after this (below uvicorn's 5 s)
UNSENT = "Can not write request body"  # aiohttp's ClientOSError when the request's write failed
# a reset (or broken pipe) before any answer: the backend closed the connection with the request unread
# (a closed socket with unread bytes resets; one that read the request and then died ends with a FIN,
# aiohttp's ServerDisconnectedError, which is not retried)
UNREAD = (errno.ECONNRESET, errno.EPIPE)


def undelivered(exc: BaseException) -> bool:
    """Whether ``exc``, raised before any byte of an answer, means the backend never got the whole
    request: the connect failed, or the connection was reset under its write (a pooled keep-alive
    connection the backend closed while idle). A backend that hung up after reading the request is
    not one: resending would repeat its work."""
    if isinstance(exc, CONNECT_ERRORS):
        return True
    return isinstance(exc, aiohttp.ClientOSError) and (UNSENT in str(exc) or exc.errno in UNREAD)


LOAD_HEADER = "X-Decode-Load"  # a decoder's self-reported load, on every answer


def retry_after_s(value: str | None, default: float = 1.0) -> float:
    try:
        return min(300.0, max(0.0, float(value))) if value is not None else default
    except ValueError:
        return default


def backend_timeout(cfg: ProxyConfig) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.request_timeout_s)


def transport_error(exc: BaseException, backend: Backend, stage: str) -> ProxyError:
    """A failure after the connection was made (or a read timeout) while `stage`."""
    if isinstance(exc, asyncio.TimeoutError):
        return ProxyError(
            504, f"{backend.role} {backend.url} timed out while {stage}", backend=backend.url, role=backend.role
        )
    return ProxyError(
        502,
        f"{backend.role} {backend.url} failed while {stage}: {type(exc).__name__}: {exc}",
        backend=backend.url,
        role=backend.role,
    )


@contextlib.asynccontextmanager
async def owned(resp: aiohttp.ClientResponse) -> AsyncIterator[aiohttp.ClientResponse]:
    """Release a finished response for connection reuse; close it on any error or
    cancellation, so that the backend sees the disconnect and stops the work."""
    try:
        yield resp
    except BaseException:
        resp.close()
        raise
    resp.release()


async def http_error(resp: aiohttp.ClientResponse, backend: Backend) -> ProxyError:
    """A non-2xx answer: 4xx and 503 (a backend that is full or shutting down: the client may retry)
    relayed as they are, anything else a 502 naming the backend."""
    text = await resp.text(errors="replace")
    if 400 <= resp.status < 500 or resp.status == 503:
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = {
                "error": {
                    "message": excerpt(text) or resp.reason,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": resp.status,
                }
            }
        return ProxyError(
            resp.status,
            f"{backend.role} {backend.url} rejected the request (HTTP {resp.status})",
            backend=backend.url,
            role=backend.role,
            relay_body=body,
            headers={"Retry-After": resp.headers.get("Retry-After", "1")} if resp.status == 503 else None,
        )
    return ProxyError(
        502,
        f"{backend.role} {backend.url} answered HTTP {resp.status}: {excerpt(text)}",
        backend=backend.url,
        role=backend.role,
    )


async def refusal_text(resp: aiohttp.ClientResponse) -> tuple[float, str]:
    """A 429 answer's ``Retry-After`` (seconds) and body text; the response is released."""
    wait_s = retry_after_s(resp.headers.get("Retry-After"))
    try:
        text = await resp.text(errors="replace")
    finally:
        resp.release()
    return wait_s, text


def json_object(text: str) -> dict | None:
    """``text`` parsed when it is a JSON object, else None."""
    try:
        answer = json.loads(text)
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def all_refused(refused: list[tuple[float, dict | None, Backend]], backends: int, role: str) -> ProxyError:
    """The 429 for the caller once every backend refused: the smallest ``Retry-After`` they gave and
    the last one's message."""
    wait_s = max(1, math.ceil(min(w for w, _, _ in refused)))
    said = refused[-1][1]
    detail = said["error"].get("message") if said and isinstance(said.get("error"), dict) else None
    message = (
        f"every {role} is at its queue limit ({len(refused)} of {backends} "
        f"answered 429); retry after {wait_s} s" + (f" ({detail})" if detail else "")
    )
    err_body = {"error": {"message": message, "type": "rate_limit_error", "param": None, "code": 429}}
    return ProxyError(
        429, message, backend=refused[-1][2].url, role=role, relay_body=err_body, headers={"Retry-After": str(wait_s)}
    )


def _unreachable(backend: Backend, cfg: ProxyConfig, last: str) -> ProxyError:
    """The 503 once every connection attempt failed; ``backend`` is the last one tried."""
    return ProxyError(
        503,
        f"no {backend.role} reachable after {cfg.max_retries + 1} attempt(s); last: {backend.url}: {last}",
        backend=backend.url,
        role=backend.role,
    )


async def _refused(
    resp: aiohttp.ClientResponse,
    lease: Lease,
    balancer: Balancer,
    tried: set[int],
    refused: list[tuple[float, dict | None, Backend]],
) -> None:
    """A 429 answer: the lease is released, the backend counts as full for its Retry-After and is
    not tried again, and its answer is kept for the caller's 429."""
    wait_s, text = await refusal_text(resp)
    lease.release()
    balancer.mark_full(lease.index, wait_s)
    tried.add(lease.index)
    refused.append((wait_s, json_object(text), lease.backend))
    log.info("backend_full", role=lease.backend.role, backend=lease.backend.url, retry_after_s=wait_s)


async def post(
    session: aiohttp.ClientSession,
    balancer: Balancer,
    cfg: ProxyConfig,
    path: str,
    body: dict[str, Any],
    *,
    headers: dict[str, str],
    num_tokens: int,
    num_kv_tokens: int = 0,
    on_retry: Callable[[Backend], None] = lambda b: None,
) -> tuple[Lease, aiohttp.ClientResponse]:
    """POST to the least-loaded backend; returns its lease and the (unread) response.

    The caller owns both: it must `lease.release()` and close the response. Raises `ProxyError`
    (503 when no backend could be reached, 502/504 for other transport failures)."""
    tried: set[int] = set()
    refused: list[tuple[float, dict | None, Backend]] = []  # (Retry-After, body, backend) of 429 answers
    attempt = 0
    while True:  # max_retries >= 0: at least one attempt; it ends in a return, a raise or a break
        full = balancer.full() - tried  # tried last
        lease = balancer.acquire(
            num_tokens, num_kv_tokens, exclude=tried | full if len(tried | full) < len(balancer.loads) else tried
        )
        backend = lease.backend
        try:
            resp = await session.post(backend.url + path, json=body, headers=headers, timeout=backend_timeout(cfg))
            balancer.report(lease.index, parse_load(resp.headers.get(LOAD_HEADER)))
            if resp.status != 429:
                return lease, resp
            await _refused(resp, lease, balancer, tried, refused)
            if len(tried) >= len(balancer.loads):
                break
        except (aiohttp.ClientOSError, aiohttp.ConnectionTimeoutError) as e:
            lease.release()
            if not undelivered(e):
                raise transport_error(e, backend, "sending the request") from None
            tried.add(lease.index)
            last = f"{type(e).__name__}: {e}"
            if attempt == cfg.max_retries:
                if refused:
                    break
                raise _unreachable(backend, cfg, last) from None
            delay = cfg.retry_backoff_s * 2**attempt
            _log_retry(backend, attempt + 1, delay, last)
            on_retry(backend)
            attempt += 1
            await asyncio.sleep(delay)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            lease.release()
            raise transport_error(e, backend, "sending the request") from None
        except BaseException:
            lease.release()
            raise
    raise all_refused(refused, len(balancer.loads), backend.role)  # every backend tried answered 429


def _log_retry(backend: Backend, attempt: int, delay_s: float, error: str) -> None:
    log.warning(
        "backend_connect_retry", role=backend.role, backend=backend.url, attempt=attempt, delay_s=delay_s, error=error
    )


async def sse_data(
    resp: aiohttp.ClientResponse,
    max_event_bytes: int = 16 * 2**20,
) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent-event stream, one per event."""
    buf = b""
    parts: list[str] = []
    async for chunk in resp.content.iter_any():
        buf += chunk
        while (cut := buf.find(b"\n")) >= 0:
            line, buf = buf[:cut].decode("utf-8", errors="replace").rstrip("\r"), buf[cut + 1 :]
            if not line:
                if parts:
                    yield "\n".join(parts)
                    parts = []
            elif line.startswith("data:"):
                parts.append(line[5:].removeprefix(" "))
        if len(buf) > max_event_bytes:
            raise ValueError(f"stream event larger than {max_event_bytes} bytes")
    if buf.strip().startswith(b"data:"):
        parts.append(buf.decode("utf-8", errors="replace").strip()[5:].lstrip())
    if parts:
        yield "\n".join(parts)


async def probe(
    session: aiohttp.ClientSession, backend: Backend, method: str, path: str, timeout_s: float
) -> dict[str, Any]:
    """One call whose result is reported, not raised: health probes and fan-out admin calls."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    result: dict[str, Any] = {"role": backend.role, "url": backend.url}
    try:
        async with session.request(method, backend.url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            text = await resp.text(errors="replace")
            result.update(http_status=resp.status, ok=200 <= resp.status < 300)
            if not result["ok"]:
                result["error"] = f"HTTP {resp.status}: {excerpt(text, 200)}"
    except asyncio.TimeoutError:
        result.update(ok=False, error=f"no answer within {timeout_s:g}s")
    except aiohttp.ClientError as e:
        result.update(ok=False, error=f"{type(e).__name__}: {e}")
    result["latency_ms"] = round((loop.time() - start) * 1000, 1)
    return result
