"""The prefill's readiness is real: while its host pool is not registered with the metastore, or
the metastore does not answer its heartbeats, HTTP ``/health`` answers 503 with the reason and its
gRPC health is NOT_SERVING; once the restarted metastore has the pool again, both say ready."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request

import pytest

from kvoffload_testing.ports import DATA_PORT_OFFSET, free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import healthy
from kvoffload_testing.stack_config import ensure_tiny_model

pytestmark = [pytest.mark.stack, pytest.mark.slow]


def _health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _wait(pred, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"not {what} within {timeout_s} s")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("health")
    cfg = StackConfig(
        model=ensure_tiny_model(tmp / "tiny"), log_dir=tmp / "logs", **free_stack_ports(), max_model_len=2048
    )
    with Stack(cfg) as s:
        yield s


def test_prefill_is_not_ready_while_the_metastore_is_gone_and_ready_once_it_has_the_pool_again(stack):
    port = stack.cfg.prefill_ports[0]
    http, grpc_health = f"http://127.0.0.1:{port}/health", f"grpc://127.0.0.1:{port + DATA_PORT_OFFSET}"
    assert _health(http)[0] == 200 and healthy(grpc_health)

    stack.signal("metastore", signal.SIGKILL)
    stack.process("metastore").wait(10)
    status, body = _wait(lambda: (got := _health(http))[0] == 503 and got, "503 from the prefill", 20)
    assert body["status"] == "not_ready" and "MetaStore" in body["reason"], body
    assert not healthy(grpc_health)

    stack.restart("metastore")  # an empty index: the next beat is refused, and the pool registers again
    _wait(lambda: _health(http)[0] == 200, "ready again", 30)
    assert healthy(grpc_health)
