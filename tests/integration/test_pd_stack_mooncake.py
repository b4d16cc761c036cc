"""The P/D stack with the prefill's host pool on Mooncake Store (``kvoffload up --pool mooncake``):
a real ``mooncake_master`` started by the stack in place of the metastore, two prefills with
``backend: "mooncake"``, one decode, the proxy. I3 through it; a long shared prefix hits the prefix
cache, also on the other prefill (read from Mooncake Store); a killed prefill that wrote a prefix
costs the request that meets its objects next a recompute of that prefix, not a failure; a killed
master fails requests at once with a clear error and the prefills report not ready, and after its
restart the next requests succeed. Plus the start-up error of a prefill whose master does not answer,
and ``up``'s flag."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from dsamodel.tokenizer import ByteTokenizer
from kvoffload_testing.connector_configs import prefill_kv_transfer_config
from kvoffload_testing.oracle import greedy_reference
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import MOONCAKE_MASTER, Stack, StackConfig
from kvoffload_testing.stack_client import post_json, stack_stats, stream_token_ids

pytestmark = [pytest.mark.stack, pytest.mark.slow]

BS = 16
TOK = ByteTokenizer()
LONG_TEXT = "".join(chr(32 + (i * 7919) % 90) for i in range(2600))
OUTAGE_S = 10.0  # a request during the outage must fail within this (no hang)
RECOVERY_S = 30.0  # the prefills are ready again this soon after the master restarted


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    cfg = StackConfig(
        model=model_dir,
        log_dir=tmp_path_factory.mktemp("mooncake-stack") / "logs",
        **free_stack_ports(2, 1, mooncake=True),
        max_model_len=8192,
        block_size=BS,
        pool="mooncake",
    )
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model_dir):
    """The oracle's greedy tokens (the model's plain full-KV path, kvoffload_testing.oracle)."""
    return greedy_reference(model_dir, block_size=BS, max_model_len=8192)


def _health(stack: Stack, port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{stack.cfg.host}:{port}/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_health(stack: Stack, status: int, timeout_s: float) -> list[dict]:
    """Every prefill's /health body, once each answers ``status`` (fails past ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [_health(stack, port) for port in stack.cfg.prefill_ports]
        if all(code == status for code, _ in got):
            return [body for _, body in got]
        assert time.monotonic() < deadline, got
        time.sleep(0.1)


def _finished(stack: Stack, request_id: str) -> list[tuple[str, dict]]:
    """(prefill name, its ``prefill_finished`` log line) for the request with that X-Request-Id."""
    time.sleep(0.3)  # the line reaches the log file
    return [
        (f"prefill-{i}", e)
        for i in range(len(stack.cfg.prefill_ports))
        for e in stack.events(f"prefill-{i}", "prefill_finished", request_id=request_id)
    ]


def test_the_stack_runs_a_real_master_in_place_of_the_metastore(stack):
    names = [s.name for s in stack.services]
    assert names == [MOONCAKE_MASTER, "decode-0", "prefill-0", "prefill-1", "proxy"]
    master = dict((n, argv) for n, argv, _ in stack.commands())[MOONCAKE_MASTER]
    assert Path(master[0]).name == "mooncake_master"
    assert f"--rpc_address={stack.cfg.host}" in master and f"--metrics_host={stack.cfg.host}" in master
    assert stack.process(MOONCAKE_MASTER).poll() is None
    assert (stack.cfg.log_dir / f"{MOONCAKE_MASTER}.log").stat().st_size > 0
    prefill = dict((n, argv) for n, argv, _ in stack.commands())["prefill-0"]
    assert "--metastore" not in prefill
    store = json.loads(prefill[prefill.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["connectors"][1]
    assert store["kv_connector_extra_config"]["backend"] == "mooncake"
    assert store["kv_connector_extra_config"]["mooncake_master"] == stack.cfg.mooncake_master
    for i in range(2):
        lines = (stack.cfg.log_dir / f"prefill-{i}.log").read_text()
        assert '"event": "mooncake_pool_connected"' in lines and stack.cfg.mooncake_master in lines
    assert "metastore" not in stack_stats(stack.cfg)


@pytest.mark.parametrize("prompt", [[65], list(range(66, 66 + BS - 1)), "long"], ids=["1", "bs-1", "2600"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_i3_completions(stack, reference, prompt, stream):
    ids = TOK.encode(LONG_TEXT, add_bos=True) if prompt == "long" else prompt
    body = {"prompt": ids, "max_tokens": 10, "temperature": 0}
    url = f"{stack.url}/v1/completions"
    got = stream_token_ids(url, body) if stream else post_json(url, body)["choices"][0]["token_ids"]
    assert got == reference(ids, 10)


def test_a_shared_long_prefix_hits_the_prefix_cache_on_both_prefills(stack, reference):
    """Three prompts sharing a 1500-token prefix, one after another: the proxy spreads them over
    both prefills (round robin among idle ones), so at least one later request runs on the prefill
    that did not write the prefix and reads it from Mooncake Store. Every later one reports the
    whole shared prefix (rounded down to blocks) as cached; tokens equal the reference."""
    prefix = "".join(chr(40 + (i * 31) % 80) for i in range(1500))
    served = []
    for n in range(3):
        ids = TOK.encode(prefix + f" question {n}: why?", add_bos=True)
        rid = f"mooncake-prefix-{uuid.uuid4().hex}"
        out = post_json(
            f"{stack.url}/v1/completions",
            {"prompt": ids, "max_tokens": 6, "temperature": 0},
            headers={"X-Request-Id": rid},
        )
        assert out["choices"][0]["token_ids"] == reference(ids, 6)
        [(name, event)] = _finished(stack, rid)
        served.append((name, event["cached_tokens"]))
    assert served[0][1] == 0, served
    shared = (1 + 1500) // BS * BS  # BOS + prefix, whole blocks
    assert all(cached >= shared for _, cached in served[1:]), served
    assert {name for name, _ in served} == {"prefill-0", "prefill-1"}, served  # a hit across processes


def test_nothing_is_left_held(stack):
    post_json(f"{stack.url}/v1/completions", {"prompt": "one more", "max_tokens": 3, "temperature": 0})
    stats = stack_stats(stack.cfg)
    for name in ("prefill-0", "prefill-1"):
        assert stats[name]["held_slots"] == 0 and stats[name]["pool_live_leases"] == 0, stats[name]
        assert stats[name]["pool_available"] == 1
    assert stats["decode-0"]["pool_used_bytes"] == 0 and stats["decode-0"]["sequences"] == 0


def test_a_dead_prefix_owner_costs_a_recompute_not_a_request(stack, reference):
    """The prefill that wrote a shared prefix is SIGKILLed. The master lists its objects until its
    client_ttl (10 s), but their bytes died with it: the next request with that prefix, on the
    other prefill, meets them, which removes them from the store, and computes the prefix again
    in the same request (``prefill_prefix_unreachable`` in its log): it succeeds with the
    reference tokens, at once, well within the client_ttl; the requests after it find no stale
    objects. Then the dead prefill restarts and both serve."""
    prefix = "".join(chr(35 + (i * 17) % 85) for i in range(1200))
    url = f"{stack.url}/v1/completions"

    def ask(n: int) -> tuple[str, dict, str]:
        ids = TOK.encode(prefix + f" ask {n}", add_bos=True)
        rid = f"mooncake-dead-owner-{uuid.uuid4().hex}"
        out = post_json(
            url,
            {"prompt": ids, "max_tokens": 5, "temperature": 0},
            headers={"X-Request-Id": rid},
            timeout_s=OUTAGE_S + 5,
        )
        assert out["choices"][0]["token_ids"] == reference(ids, 5)
        [(name, event)] = _finished(stack, rid)
        return name, event, rid

    owner, first, _ = ask(0)
    assert first["cached_tokens"] == 0
    stack.signal(owner, signal.SIGKILL)
    stack.process(owner).wait(10)
    t = time.monotonic()
    name, event, rid = ask(1)  # well within the master's client_ttl (10 s)
    assert time.monotonic() - t < OUTAGE_S and name != owner
    assert event["cached_tokens"] == 0, event
    [why] = stack.events(name, "prefill_prefix_unreachable", request_id=rid)
    assert "owner's segment does not answer" in why["error"], why
    for n in (2, 3):
        name, event, rid = ask(n)
        assert name != owner and not stack.events(name, "prefill_prefix_unreachable", request_id=rid)
    stack.restart(owner)
    _wait_health(stack, 200, RECOVERY_S)
    assert ask(4)[1]["cached_tokens"] >= (1 + 1200) // BS * BS  # the prefix, written again, hits


def test_master_killed_fails_requests_clearly_and_its_restart_recovers(stack, reference):
    """Runs last in this module (it restarts the master). While the master is down: the prefills'
    health says why, and requests fail within OUTAGE_S with an error naming Mooncake Store. After
    the restart (a fresh master: every key lost) the prefills put their objects again, report
    ready, and the next requests succeed with the reference tokens."""
    url = f"{stack.url}/v1/completions"
    stack.signal(MOONCAKE_MASTER, signal.SIGKILL)
    stack.process(MOONCAKE_MASTER).wait(10)
    bodies = _wait_health(stack, 503, 10)
    assert all(f"the mooncake_master at {stack.cfg.mooncake_master} does not answer" in b["reason"] for b in bodies)
    for n in range(2):
        t = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as info:
            post_json(
                url,
                {"prompt": f"during the outage {n} " * 20, "max_tokens": 4, "temperature": 0},
                timeout_s=OUTAGE_S + 5,
            )
        assert time.monotonic() - t < OUTAGE_S
        assert info.value.code >= 500
        message = info.value.read().decode()
        assert "Mooncake Store" in message or "mooncake_master" in message, message
    stack.restart(MOONCAKE_MASTER)
    _wait_health(stack, 200, RECOVERY_S)
    for n in range(3):
        ids = TOK.encode(f"after the restart {n} " + LONG_TEXT[:400], add_bos=True)
        assert post_json(url, {"prompt": ids, "max_tokens": 6, "temperature": 0})["choices"][0][
            "token_ids"
        ] == reference(ids, 6)


def test_prefill_without_a_master_is_a_start_up_error(model_dir):
    """A prefill whose mooncake_master does not answer exits 2 at once, naming the address, without
    falling back to another pool."""
    from poolbackends.mooncake_master import free_port

    master = f"127.0.0.1:{free_port('127.0.0.1')}"
    kv = prefill_kv_transfer_config(20050, mooncake_master=master)
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("kvoffload-prefill")),
            "--model",
            str(model_dir),
            "--port",
            "1",
            "--kv-transfer-config",
            kv,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("kvoffload-prefill: "))
    assert line.startswith(f"kvoffload-prefill: backend 'mooncake': no mooncake_master answers at {master}"), line


def test_up_takes_pool_mooncake_for_the_reference_engine_only(tmp_path, capsys):
    from kvoffload.cli import build_parser, main
    from kvoffload.cli_stack import stack_config

    args = build_parser().parse_args(["up", "--pool", "mooncake", "--model", str(tmp_path), "--log-dir", str(tmp_path)])
    cfg = stack_config(args)
    assert cfg.pool == "mooncake"
    assert [n for n, _, _ in Stack(cfg).commands()][0] == MOONCAKE_MASTER
    assert build_parser().parse_args(["up"]).pool == "kvoffload"  # the default stays the embedded pool
    with pytest.raises(SystemExit) as info:
        main(["up", "--engine", "vllm", "--pool", "mooncake"])
    assert info.value.code == 2
    assert "--pool mooncake: only with --engine reference" in capsys.readouterr().err


def test_prefill_pool_flags_with_the_mooncake_backend(tmp_path):
    """--metastore has no meaning with backend mooncake (a ConfigError naming both); the pool size
    keeps its one rule: --host-pool-gb / host_pool_gb > mmc-local.conf's dram.size > 1 GiB."""
    import argparse

    from kvcore.config.connectors import StoreConnectorConfig
    from kvcore.config.errors import ConfigError
    from kvoffload_prefill.options import pool_flags

    def args(**kw):
        return argparse.Namespace(**{"metastore": None, "host_pool_gb": None, "local_config": None, **kw})

    store = StoreConnectorConfig(backend="mooncake", mooncake_master="127.0.0.1:50051")
    with pytest.raises(ConfigError) as info:
        pool_flags(args(metastore="127.0.0.1:5000"), store, {})
    assert str(info.value) == (
        "--metastore 127.0.0.1:5000: applies to backend 'kvoffload' only; backend 'mooncake' "
        "keeps its objects in the mooncake_master (kv_connector_extra_config.mooncake_master)"
    )
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("ock.mmc.local_service.dram.size = 3GB\n")
    for a, cfg, size, source in [
        (args(), store, 2**30, "default (1 GiB)"),
        (args(local_config=str(conf)), store, 3 * 2**30, f"ock.mmc.local_service.dram.size ({conf}:1)"),
        (args(host_pool_gb=0.5, local_config=str(conf)), store, 2**29, "--host-pool-gb"),
        (
            args(),
            StoreConnectorConfig(backend="mooncake", mooncake_master="h:1", host_pool_gb=2),
            2 * 2**30,
            "kv_connector_extra_config.host_pool_gb",
        ),
    ]:
        flags = pool_flags(a, cfg, {})
        assert (flags.host_pool_bytes, flags.metastore) == (size, None)
        assert flags.host_pool_source.startswith(source.split(" (")[0]), flags.host_pool_source


def test_a_taken_master_port_stops_the_stack_before_anything_starts(model_dir, tmp_path):
    """A mooncake_master keeps running when it cannot bind its RPC port, and the health probe would
    reach whatever listens on the metrics port: the stack refuses such ports up front."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        ports = {**free_stack_ports(1, 1, mooncake=True), "mooncake_port": other.getsockname()[1]}
        stack = Stack(StackConfig(model=model_dir, log_dir=tmp_path / "logs", pool="mooncake", **ports))
        with pytest.raises(RuntimeError, match=rf"something listens on port\(s\) \[{ports['mooncake_port']}\]"):
            stack.start(progress=False)
    assert stack.services == []
