"""svcruntime.serving: start-up errors become one line and exit 2; the gRPC side reports real
readiness (asked at every check, NOT_SERVING before start and after drain) and Stats from a
snapshot; the ordered shutdown calls every closer in order, even after a failed serve."""

from __future__ import annotations

import argparse

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcore.config.errors import ConfigError
from kvoffload_proto.v1 import stats_pb2, stats_pb2_grpc
from svcruntime import serving
from svcruntime.serving import GrpcSide, StartupError, StatsSnapshot, run, start_process

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("exc", [StartupError("no model"), ConfigError(["--port: got 0; must be a port"])])
def test_a_startup_error_is_one_line_and_exit_2(capsys, exc):
    def body() -> int:
        raise exc

    assert run("svc", body) == 2
    assert capsys.readouterr().err == f"svc: {exc}\n"


def test_run_returns_the_bodys_status_and_lets_other_errors_through():
    assert run("svc", lambda: 0) == 0
    with pytest.raises(KeyError):
        run("svc", lambda: {}["x"])


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(tls_cert=None, tls_key=None, tls_ca=None, **kw)


def test_start_process_checks_flags_and_the_log_level_first():
    with pytest.raises(ConfigError, match="--port: got 0"):
        start_process("svc", _args(port=0), ports=("port",))
    with pytest.raises(StartupError, match="--log-level"):
        start_process("svc", _args(port=80), log_level="loud", ports=("port",))


@pytest.fixture
def side():
    reason = {"now": ""}
    calls = []

    def snapshot(include_ledger: bool) -> StatsSnapshot:
        calls.append(include_ledger)
        return StatsSnapshot({"held": 2}, {"plan": "p"}, '{"requests": []}')

    g = GrpcSide("svc", "9.9", snapshot, workers=2, not_ready=lambda: reason["now"])
    port = g.add_port("127.0.0.1:0", None)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield g, reason, calls, channel
    channel.close()
    g.stop(0)


def _check(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_health_follows_readiness_from_start_to_drain(side):
    g, reason, _, channel = side
    g.server.start()  # serving RPCs, but not started as a service yet
    assert _check(channel) == NOT_SERVING
    g.health.start()
    assert _check(channel) == SERVING
    reason["now"] = "pool not registered"
    assert _check(channel) == NOT_SERVING
    reason["now"] = ""
    assert _check(channel) == SERVING
    g.health.drain()
    assert _check(channel) == NOT_SERVING  # draining wins over ready


def test_stats_answers_from_the_snapshot(side):
    g, _, calls, channel = side
    g.start()
    stub = stats_pb2_grpc.StatsStub(channel)
    plain = stub.GetStats(stats_pb2.StatsRequest(), timeout=5)
    full = stub.GetStats(stats_pb2.StatsRequest(include_ledger=True), timeout=5)
    assert (plain.service, plain.version, dict(plain.counters), dict(plain.info)) == (
        "svc",
        "9.9",
        {"held": 2.0},
        {"plan": "p"},
    )
    assert plain.ledger_json == "" and full.ledger_json == '{"requests": []}' and calls == [False, True]


def test_serve_http_closes_in_order_even_when_serving_fails(side, monkeypatch):
    g, _, _, _ = side
    g.start()
    order = []

    async def broken(*_a, **_k):
        raise OSError("address in use")

    monkeypatch.setattr(serving, "serve_until_signal", broken)
    with pytest.raises(OSError, match="address in use"):
        serving.serve_http(
            None,
            "127.0.0.1",
            0,
            busy=lambda: 0,
            grace_s=0,
            grpc_side=g,
            closers=(lambda: order.append("worker"), lambda: order.append("pool")),
        )
    assert order == ["worker", "pool"]
