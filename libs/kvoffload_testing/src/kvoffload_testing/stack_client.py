"""Talking to a running stack: health probes, completions, and the services' Stats counters."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

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


def stack_stats(cfg) -> dict[str, dict[str, float]]:
    """Stats of the metastore (pool "kvoffload"), every prefill (data port) and decode (control port) of
    the stack ``cfg`` (a ``kvoffload_testing.stack.StackConfig``) describes."""
    out = {"metastore": grpc_stats(f"{cfg.host}:{cfg.metastore_port}", tls=cfg.tls)} if cfg.pool == "kvoffload" else {}
    for i, port in enumerate(cfg.prefill_ports):
        out[f"prefill-{i}"] = grpc_stats(f"{cfg.host}:{port + DATA_PORT_OFFSET}", tls=cfg.tls)
    for i, _ in enumerate(() if cfg.mode == "offload-only" else cfg.decode_ports):
        out[f"decode-{i}"] = grpc_stats(f"{cfg.host}:{cfg.decode_control_port(i)}", tls=cfg.tls)
    return out
