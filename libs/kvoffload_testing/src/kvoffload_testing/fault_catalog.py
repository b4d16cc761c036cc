"""The fault suite's catalogue: the faults it injects, and the error each may give a request.

``FAULTS`` (a stack whose prefill pool the metastore indexes) and ``MOONCAKE_FAULTS`` (a prefill pool
on Mooncake Store) weigh each fault kind in a randomized run; ``SERVER_FAULTS`` are the kills of a
pool's server (its ``kvcore.pool.registry`` entry's stack service). ``EXPECTED_ERRORS`` says what a request
a fault failed must have been told: the fault's status, and a message naming the service it hit
(``peer_names`` for a loopback stack, ``named_peers`` for any other, e.g. containers: how the proxy and
the services name each one); ``wrong_error`` judges an error against it (any 50x is not enough).
The suite's client is here too: ``request`` (one completion; its error written the way
``error_status`` reads it, an SSE error event by ``sse_error``; ``on_sent`` says when the whole request
was written, so a run knows which requests a fault met in flight).
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcore.pool.registry import POOL_BACKENDS
from kvoffload_testing.ports import DATA_PORT_OFFSET
from kvoffload_testing.sse import StreamTruncated, sse_events, token_ids
from kvoffload_testing.stack import StackConfig

# the fault that kill -9s the server of a stack's pool -> that service ("kill_metastore": "metastore")
SERVER_FAULTS: dict[str, str] = {
    f"kill_{b.stack.service.replace('-', '_')}": b.stack.service for b in POOL_BACKENDS.values() if b.stack
}

# fault -> relative weight in a randomized run
FAULTS: dict[str, int] = {
    "none": 1,
    "kill_decode": 2,
    "kill_prefill": 2,
    "kill_metastore": 1,
    "kill_proxy": 1,
    "stall_decode_short": 2,
    "stall_decode_long": 2,
    "stall_prefill_long": 2,
    "expire_pool_and_leases": 1,
    "overfill_decode": 1,
    "fill_host_pool": 1,
}
# the faults of a stack whose prefill pool is on Mooncake Store: no metastore to kill or to let the
# pool expire at; its master instead, and kill_prefill leaves a dead segment owner (module docstring)
MOONCAKE_FAULTS: dict[str, int] = {
    "none": 1,
    "kill_decode": 2,
    "kill_prefill": 2,
    "kill_mooncake_master": 2,
    "kill_proxy": 1,
    "stall_decode_short": 1,
    "stall_decode_long": 1,
    "stall_prefill_long": 1,
    "overfill_decode": 1,
    "fill_host_pool": 1,
}
FAULTS_BY_POOL = {"kvoffload": FAULTS, "mooncake": MOONCAKE_FAULTS}  # one per kvcore.pool.registry.STACK_POOLS


MAX_TOKENS = 6  # what the suite's completions ask for
ERROR_CHARS = 2000  # of an error body: enough for the proxy's message and the backend's it quotes


def request(
    url: str,
    prompt: list[int],
    stream: bool,
    deadline_s: float,
    max_tokens: int = MAX_TOKENS,
    on_sent: Callable[[], None] | None = None,
) -> tuple[bool, list[int], str]:
    """(ok, tokens, error) of one completion; an error event mid-stream is a failure. The error says
    its status first ("HTTP 502: <body>", "SSE error 502: <message>"; ``error_status`` reads it)
    or, with no HTTP answer, the exception ("RemoteDisconnected: ..."). ``on_sent`` is called once
    the whole request has been written to the connection (never when it could not be sent)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with _opener(on_sent).open(req, timeout=deadline_s) as resp:
            if not stream:
                out = json.loads(resp.read())
                return True, out["choices"][0]["token_ids"], ""
            ids: list[int] = []
            try:
                for event in sse_events(resp, require_done=True, until_done=True):
                    if "error" in event:
                        return False, ids, sse_error(event["error"])
                    ids.extend(token_ids(event))
            except StreamTruncated:
                return False, ids, "the stream ended without data: [DONE] (truncated)"
            return True, ids, ""
    except urllib.error.HTTPError as exc:
        return False, [], f"HTTP {exc.code}: {exc.read()[:ERROR_CHARS].decode(errors='replace')}"
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        return False, [], f"{type(exc).__name__}: {exc}"


def _opener(on_sent: Callable[[], None] | None) -> urllib.request.OpenerDirector:
    """urllib's opener, whose plain-HTTP connections call ``on_sent`` once a request is written."""
    if on_sent is None:
        return urllib.request.build_opener()
    sent = on_sent

    class Connection(http.client.HTTPConnection):
        def request(self, *args: Any, **kwargs: Any) -> None:
            super().request(*args, **kwargs)  # headers and body are in the socket now
            sent()

    class Handler(urllib.request.HTTPHandler):
        def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
            return self.do_open(Connection, req)

    return urllib.request.build_opener(Handler)


def error_status(error: str) -> int | None:
    """The HTTP status an error of ``request`` carries (an SSE error event's code), None when the
    request got no HTTP answer (the connection broke)."""
    m = re.match(r"(?:HTTP|SSE error) (\d{3})\b", error)
    return int(m.group(1)) if m else None


def sse_error(error: object) -> str:
    """An SSE error event's error object as "SSE error <code>: <message>" (no code: "SSE error: ...")."""
    if not isinstance(error, dict):
        return f"SSE error: {error}"
    code = error.get("code")
    return f"SSE error{f' {code}' if isinstance(code, int) else ''}: {error.get('message', error)}"


# ---- the error each fault may give ----------------------------------------------------------------


@dataclass(frozen=True)
class ExpectedError:
    """What a request that ``fault`` failed must have been told: one of ``statuses`` (None: no HTTP
    answer, the client's connection broke) and a message that names ``peer``, the service the fault
    hit, the way the proxy and the services name it (``peer_names``), and says ``says`` when set.
    No statuses: the fault must fail no request."""

    statuses: frozenset[int | None] = frozenset()
    peer: str = ""
    says: str = ""


# What each fault gives, read off how the proxy and the services fail (services/proxy upstream.py,
# flow.py; the decode's app.py and watchdog; the prefill's worker; pdlink's links):
# - a dead decode: the proxy's 502 "decoder <url> failed while sending the request / relaying the
#   response" (an SSE error once streaming), or 503 "no decoder reachable"; or the prefill's 502 about
#   its peer ("decode <host:port> no longer waits", "the decode did not read layer(s)"), relayed as
#   "prefiller <url> answered HTTP 502";
# - a dead prefill: 502 "prefiller <url> failed while running the prefill" / 503 "no prefiller
#   reachable", or the decode's watchdog, "prefill <host:port> sent no news", relayed as 502;
# - a dead metastore: the prefill's 502 "prefill failed: MetaStore <call>: UNAVAILABLE";
# - a dead proxy: no HTTP answer, the connection breaks;
# - a decode stopped past the peer timeout: the prefill's 502 (its reads not done); a prefill
#   stopped past it (and past the pool's heartbeat timeout): the decode's watchdog, 502;
# - more requests than the decode's queue holds: 429 "every decoder is at its queue limit";
# - a prompt the prefill's host pool cannot hold: the prefill's 502 "host pool full";
# - a dead mooncake_master: the prefill's 502 naming Mooncake's failed call ("Mooncake Store exists
#   failed ... the master does not answer").
EXPECTED_ERRORS: dict[str, ExpectedError] = {
    "none": ExpectedError(),
    "stall_decode_short": ExpectedError(),  # READ_DONE only delayed: nothing fails
    "kill_decode": ExpectedError(frozenset({502, 503}), "decode"),
    "kill_prefill": ExpectedError(frozenset({502, 503}), "prefill"),
    **{fault: ExpectedError(frozenset({502}), service) for fault, service in SERVER_FAULTS.items()},
    "kill_proxy": ExpectedError(frozenset({None}), "proxy"),
    "stall_decode_long": ExpectedError(frozenset({502}), "decode"),
    "stall_prefill_long": ExpectedError(frozenset({502}), "prefill"),
    "expire_pool_and_leases": ExpectedError(frozenset({502}), "prefill"),
    "overfill_decode": ExpectedError(frozenset({429}), "decode", "queue limit"),
    "fill_host_pool": ExpectedError(frozenset({502}), "prefill", "host pool full"),
}


def peer_names(cfg: StackConfig) -> dict[str, tuple[str, ...]]:
    """How errors name each service of a one-prefill, one-decode loopback stack ``cfg``
    (``named_peers``)."""
    h, prefill, decode = cfg.host, cfg.prefill_ports[0], cfg.decode_ports[0]
    return named_peers((h, prefill, prefill + DATA_PORT_OFFSET), (h, decode, cfg.decode_control_port(0)))


def named_peers(prefill: tuple[str, int, int], decode: tuple[str, int, int]) -> dict[str, tuple[str, ...]]:
    """How errors name each service of a one-prefill, one-decode stack whose ``prefill`` and ``decode``
    are (the host they advertise, HTTP port, gRPC port: the prefill's data port, the decode's control
    port): the proxy names a backend by role and URL ("decoder http://host:port"; "every decoder"
    when all refused), the services their peers by role and gRPC address ("prefill host:data_port",
    "decode host:control_port") or role ("the decode did not read ..."); a pool's server (the
    metastore, Mooncake) by the words of its ``kvcore.pool.registry`` entry. A broken connection to the
    proxy is named by the exception that says so."""
    (ph, p_http, p_grpc), (dh, d_http, d_grpc) = prefill, decode
    return {
        "decode": (f"http://{dh}:{d_http}", f"decode {dh}:{d_grpc}", "the decode ", "every decoder "),
        "prefill": (f"http://{ph}:{p_http}", f"prefill {ph}:{p_grpc}", "the prefill "),
        **{b.stack.service: b.stack.named for b in POOL_BACKENDS.values() if b.stack},
        "proxy": (
            "RemoteDisconnected",
            "ConnectionResetError",
            "ConnectionRefusedError",
            "Connection refused",
            "IncompleteRead",
            "BrokenPipeError",
            "the stream ended without data: [DONE]",
        ),
    }


def _shown(status: int | None) -> str:
    return "no HTTP answer" if status is None else f"HTTP {status}"


def wrong_error(fault: str, error: str, names: dict[str, tuple[str, ...]]) -> str:
    """Why ``error`` (a failed request's, as ``request`` wrote it) is not what ``fault`` gives
    (``EXPECTED_ERRORS``); "" when it is. Any 50x is not enough: the status must be the fault's and
    the message must name the service the fault hit."""
    want = EXPECTED_ERRORS[fault]
    status = error_status(error)
    if not want.statuses:
        return f"{fault} must fail no request; this one got {_shown(status)}"
    if status not in want.statuses:
        wanted = " or ".join(sorted(map(_shown, want.statuses)))
        return f"{fault} gives {wanted}, not {_shown(status)}"
    if not any(name in error for name in names[want.peer]):
        return f"{fault}: the error does not name the {want.peer} ({' / '.join(names[want.peer])})"
    if want.says and want.says not in error:
        return f"{fault}: the error does not say {want.says!r}"
    return ""
