"""Talking to a running stack: health probes, completions, and the services' Stats counters."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

from kvoffload_testing.logtail import tail
from kvoffload_testing.ports import DATA_PORT_OFFSET
from kvoffload_testing.sse import sse_events, token_ids
from svcruntime.tls import TLSConfig


def healthy(url: str, tls: TLSConfig | None = None) -> bool:
    """HTTP 200 from an http:// URL, or SERVING from the gRPC health service at grpc://host:port
    (over TLS with ``tls``)."""
    if url.startswith("grpc://"):
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from svcruntime.tls import secure_or_insecure_channel

        try:
            with secure_or_insecure_channel(url[len("grpc://") :], tls) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                reply = stub.Check(  # type: ignore[attr-defined]  # types-grpcio-health-checking omits Check
                    health_pb2.HealthCheckRequest(), timeout=2
                )  # (the generated class binds it in __init__)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return False  # HTTPException: not an HTTP server there (e.g. a socket connected to itself)


def post_json(url: str, body: dict, timeout_s: float = 300.0, headers: dict[str, str] | None = None) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def stream_token_ids(url: str, body: dict, timeout_s: float = 300.0) -> list[int]:
    """POST ``body`` with ``stream: true``; the token ids of every SSE event, in order (an event
    carrying an error raises AssertionError with it)."""
    req = urllib.request.Request(
        url, data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"}
    )
    ids: list[int] = []
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for event in sse_events(resp):
            assert "error" not in event, event
            ids.extend(token_ids(event))
    return ids


def grpc_stats(target: str, timeout_s: float = 15.0, tls: TLSConfig | None = None) -> dict[str, float]:
    """A service's ``kvoffload.v1.Stats`` counters (over TLS with ``tls``). The timeout allows for a
    loaded machine: with the tests on two workers a prefill just started once took over 5 s to accept
    the connection (its HTTP/2 SETTINGS frame)."""
    from kvoffload_proto.v1 import stats_pb2, stats_pb2_grpc
    from svcruntime.tls import secure_or_insecure_channel

    with secure_or_insecure_channel(target, tls) as ch:
        reply = stats_pb2_grpc.StatsStub(ch).GetStats(stats_pb2.StatsRequest(), timeout=timeout_s)
    return dict(reply.counters)


class StatsUnavailable(RuntimeError):
    """A service of a stack did not answer its Stats call; the message names it, its address, the gRPC
    status, and ends with its log's last lines (a dead service's last words, a hung one's last event)."""


def stack_stats(cfg) -> dict[str, dict[str, float]]:
    """Stats of the metastore (pool "kvoffload"), every prefill (data port) and decode (control port) of
    the stack ``cfg`` (a ``kvoffload_testing.stack.StackConfig``) describes; :class:`StatsUnavailable`
    when one does not answer."""
    targets = {"metastore": cfg.metastore_port} if cfg.pool == "kvoffload" else {}
    targets.update({f"prefill-{i}": port + DATA_PORT_OFFSET for i, port in enumerate(cfg.prefill_ports)})
    if cfg.mode != "offload-only":
        targets.update({f"decode-{i}": cfg.decode_control_port(i) for i, _ in enumerate(cfg.decode_ports)})
    return {name: _service_stats(cfg, name, f"{cfg.host}:{port}") for name, port in targets.items()}


def _service_stats(cfg, name: str, target: str) -> dict[str, float]:
    import grpc

    try:
        return grpc_stats(target, tls=cfg.tls)
    except grpc.RpcError as exc:
        log = cfg.log_path(name)
        raise StatsUnavailable(
            f"{name}'s Stats on {target}: {exc.code()} {exc.details()}; "
            f"{log} ends with:\n{tail(log, LOG_TAIL_LINES) or '(nothing)'}"
        ) from exc


LOG_TAIL_LINES = 20  # of a service's log, in StatsUnavailable
