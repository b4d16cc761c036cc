"""``kvoffload up/demo --engine vllm`` without vLLM running: the exact connector configs, the command
lines, and the launcher (ordered start with the metastore first, health waits, one log per child,
ordered shutdown of whole process groups) on fake children."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig, colocated_threads_env
from kvoffload_testing.vllm_stack import (
    VllmStack,
    split_cores,
    vllm_decode_transfer_config,
    vllm_prefill_transfer_config,
)

# ---- configs and command lines -----------------------------------------------------------------


def test_the_prefill_transfer_config_is_the_multiconnector_of_the_d2h_producer_and_the_layerwise_store():
    config = json.loads(vllm_prefill_transfer_config("127.0.0.1:5000"))
    d2h, store = config["kv_connector_extra_config"].pop("connectors")
    assert config == {"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {}}
    assert d2h == {
        "kv_connector": "SfaRemoteD2HConnector",
        "kv_role": "kv_producer",
        "kv_connector_module_path": "kvoffload_vllm",
        "kv_connector_extra_config": {"transfer_backend": "kvoffload"},
    }
    assert store == {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_producer",
        "kv_connector_module_path": "kvoffload_vllm",
        "kv_connector_extra_config": {
            "backend": "kvoffload",
            "use_layerwise": True,
            "metastore": "127.0.0.1:5000",
            "layerwise_num_shared_buffers": 3,  # the seed's shared layer buffers on the prefill
        },
    }
    plain = json.loads(vllm_prefill_transfer_config("127.0.0.1:5000", shared_buffers=None))
    assert (
        "layerwise_num_shared_buffers"
        not in plain["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    )


def test_the_decode_transfer_config_is_the_d2h_consumer_on_its_control_port():
    assert json.loads(vllm_decode_transfer_config(20050)) == {
        "kv_connector": "SfaRemoteD2HConnector",
        "kv_role": "kv_consumer",
        "kv_port": 20050,
        "kv_connector_module_path": "kvoffload_vllm",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"transfer_backend": "kvoffload"},
    }


def _cfg(tmp_path: Path, **kw) -> StackConfig:
    return StackConfig(model=tmp_path / "model", log_dir=tmp_path / "logs", **{**free_stack_ports(), **kw})


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_commands_metastore_prefill_decode_proxy_in_start_order(tmp_path):
    cfg = _cfg(tmp_path, max_model_len=2048)
    stack = VllmStack(cfg)
    cmds = {name: (argv, health) for name, argv, health in stack.commands()}
    assert [name for name, _, _ in stack.commands()] == ["metastore", "prefill-0", "decode-0", "proxy"]
    # the metastore and the proxy are the reference stack's own commands
    ref = {name: (argv, health) for name, argv, health in Stack(cfg).commands()}
    assert cmds["metastore"] == ref["metastore"] and cmds["proxy"] == ref["proxy"]
    assert cmds["metastore"][1] == f"grpc://127.0.0.1:{cfg.metastore_port}"
    for name, port, config in (
        ("prefill-0", cfg.prefill_ports[0], vllm_prefill_transfer_config(f"127.0.0.1:{cfg.metastore_port}")),
        ("decode-0", cfg.decode_ports[0], vllm_decode_transfer_config(cfg.kv_port)),
    ):
        argv, health = cmds[name]
        assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
        assert _flag(argv, "--model") == str(cfg.model) and _flag(argv, "--port") == str(port)
        assert _flag(argv, "--host") == "127.0.0.1" and _flag(argv, "--max-model-len") == "2048"
        assert _flag(argv, "--dtype") == "float32" and "--enforce-eager" in argv
        assert _flag(argv, "--kv-transfer-config") == config
        assert health == f"http://127.0.0.1:{port}/health"
    proxy = cmds["proxy"][0]
    assert _flag(proxy, "--prefiller-ports") == str(cfg.prefill_ports[0])
    assert _flag(proxy, "--decoder-ports") == str(cfg.decode_ports[0])
    assert _flag(proxy, "--prefiller-hosts") == _flag(proxy, "--decoder-hosts") == "127.0.0.1"


def test_every_decode_gets_its_own_control_port(tmp_path):
    cfg = _cfg(tmp_path, **free_stack_ports(prefills=2, decodes=2))
    cmds = {name: argv for name, argv, _ in VllmStack(cfg).commands()}
    assert list(cmds) == ["metastore", "prefill-0", "prefill-1", "decode-0", "decode-1", "proxy"]
    for i in range(2):
        assert json.loads(_flag(cmds[f"decode-{i}"], "--kv-transfer-config"))["kv_port"] == cfg.kv_port + 16 * i
    assert cmds["proxy"][cmds["proxy"].index("--decoder-ports") + 1 :][:2] == [str(p) for p in cfg.decode_ports]


def test_only_the_vllm_children_get_the_vllm_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    stack = VllmStack(_cfg(tmp_path))
    base = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    assert stack.engine_env("prefill-0") == {**base, "VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert stack.engine_env("decode-0") == {**base, "VLLM_CPU_OMP_THREADS_BIND": "2,3"}
    assert stack.engine_env("metastore") == stack.engine_env("proxy") == {}
    reference = Stack(_cfg(tmp_path)).engine_env("prefill-0")  # the reference stack's own thread plan only
    assert not any(k.startswith("VLLM_") for k in reference) and reference == colocated_threads_env(
        "prefill-0", 4, os.environ
    )
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert stack.engine_env("decode-0") == base  # one core: nothing to split


def test_prefills_and_decodes_get_disjoint_halves_of_the_cores():
    assert split_cores([0, 1]) == ("0", "1")
    assert split_cores([4, 2, 3, 5, 6]) == ("2,3", "4,5,6")
    assert split_cores([7]) is None


def test_the_vllm_stack_refuses_tls(tmp_path):
    from svcruntime.tls import TLSConfig

    with pytest.raises(ValueError, match="no TLS"):
        VllmStack(_cfg(tmp_path, tls=TLSConfig(cert=b"cert", key=b"key")))


# ---- the launcher, on fake children ----------------------------------------------------------------

FAKE_SERVICE = textwrap.dedent("""
    import http.server, os, signal, subprocess, sys, time
    name, port, events, delay, code = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
    grandchild = sys.argv[6] == "1"

    def event(*what):
        with open(events, "a") as f:
            f.write(" ".join([name, *map(str, what)]) + "\\n")

    def term(*_):
        event("sigterm")
        os._exit(0)  # a grandchild is left behind: stopping the group must end it

    signal.signal(signal.SIGTERM, term)  # first: a service stopped while it starts says so too
    event("spawned", os.environ.get("HF_HUB_OFFLINE"), os.getpid())
    if code:
        sys.exit(code)
    if grandchild:  # like vLLM's engine core: a process of the service's group, here one that ignores SIGTERM
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        event("grandchild", child.pid)
    time.sleep(delay)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Health)

    event("healthy")
    server.serve_forever()
""")


def fake_stack(
    base: type[Stack],
    cfg: StackConfig,
    script: Path,
    events: Path,
    delays: dict,
    codes: dict,
    grandchildren: bool = True,
):
    """``base``'s services (names, start order, hooks), each played by FAKE_SERVICE on an HTTP health port
    (with a grandchild that ignores SIGTERM when ``grandchildren``)."""

    class Fake(base):
        stop_grace_s = 1.0  # the grandchildren ignore SIGTERM: SIGKILL after a second

        def commands(self):
            out = []
            for name, _, health in base.commands(self):
                port = int(health.split(":")[2].split("/")[0])
                argv = [
                    sys.executable,
                    str(script),
                    name,
                    str(port),
                    str(events),
                    str(delays.get(name, 0)),
                    str(codes.get(name, 0)),
                    "1" if grandchildren else "0",
                ]
                out.append((name, argv, f"http://127.0.0.1:{port}/"))
            return out

    script.write_text(FAKE_SERVICE)
    return Fake(cfg)


def read_events(events: Path) -> list[tuple[str, ...]]:
    return [tuple(line.split()) for line in events.read_text().splitlines()]


def index(evs, *event) -> int:
    return next(i for i, e in enumerate(evs) if e[: len(event)] == event)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def test_vllm_stack_starts_metastore_first_then_the_rest_and_stops_whole_groups_in_reverse(tmp_path):
    cfg, events = _cfg(tmp_path), tmp_path / "events"
    stack = fake_stack(
        VllmStack, cfg, tmp_path / "fake.py", events, delays={"metastore": 1.0, "prefill-0": 1.5}, codes={}
    )
    stack.start(timeout_s=60, progress=False)
    try:
        evs = read_events(events)
        # the prefill (its store registers with the metastore) waits for the metastore's health...
        assert index(evs, "prefill-0", "spawned") > index(evs, "metastore", "healthy")
        # ...the decode starts beside the prefill, not after it
        assert index(evs, "decode-0", "spawned") < index(evs, "prefill-0", "healthy")
        names = ["metastore", "prefill-0", "decode-0", "proxy"]
        assert [s.name for s in stack.services] == names
        assert all((cfg.log_dir / f"{n}.log").exists() for n in names)
        env = {e[0]: e[2] for e in evs if e[1] == "spawned"}
        assert env == {"metastore": "None", "prefill-0": "1", "decode-0": "1", "proxy": "None"}
    finally:
        stack.stop()
    evs = read_events(events)
    assert [e[0] for e in evs if e[1] == "sigterm"] == ["proxy", "decode-0", "prefill-0", "metastore"]
    grandchildren = [int(e[2]) for e in evs if e[1] == "grandchild"]
    assert len(grandchildren) == 4 and not any(pid_alive(p) for p in grandchildren)
    assert stack.services == []


def test_a_child_that_dies_while_starting_stops_the_others_and_names_itself(tmp_path):
    cfg, events = _cfg(tmp_path), tmp_path / "events"
    stack = fake_stack(VllmStack, cfg, tmp_path / "fake.py", events, delays={}, codes={"decode-0": 3})
    with pytest.raises(RuntimeError, match=r"decode-0 exited with status 3 while starting; its log \("):
        stack.start(timeout_s=60, progress=False)
    evs = read_events(events)
    # every other service that had started running (its handler installed: "spawned" is written after it)
    # got SIGTERM, in reverse start order; one stopped before its interpreter ran a line writes nothing,
    # and only the metastore (healthy before the others spawn) is sure to have run
    running = {e[0] for e in evs if e[1] == "spawned"} - {"decode-0"}
    assert "metastore" in running
    stopped = [e[0] for e in evs if e[1] == "sigterm"]
    assert stopped == [n for n in ["proxy", "prefill-0", "metastore"] if n in running], (stopped, running)
    assert not any(pid_alive(int(e[3])) for e in evs if e[1] == "spawned")
    assert not any(pid_alive(int(e[2])) for e in evs if e[1] == "grandchild")
    assert stack.services == []


def test_the_reference_stack_spawns_the_decode_at_once_and_the_prefill_once_the_metastore_answers(tmp_path):
    cfg, events = _cfg(tmp_path), tmp_path / "events"
    stack = fake_stack(
        Stack, cfg, tmp_path / "fake.py", events, delays={"metastore": 1.0}, codes={}, grandchildren=False
    )
    t = time.monotonic()
    stack.start(timeout_s=60, progress=False)
    stack.stop()
    evs = read_events(events)
    assert index(evs, "decode-0", "spawned") < index(evs, "metastore", "healthy")
    assert index(evs, "metastore", "healthy") < min(index(evs, "prefill-0", "spawned"), index(evs, "proxy", "spawned"))
    assert [e[0] for e in evs if e[1] == "sigterm"] == ["proxy", "prefill-0", "decode-0", "metastore"]
    assert time.monotonic() - t < 30
