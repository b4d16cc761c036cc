"""``kvoffload up/demo --engine vllm`` without vLLM running: the exact connector configs, the command
lines, the flags refused, and the launcher (ordered start with the metastore first, health waits,
one log per child, ordered shutdown of whole process groups) on fake children."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvoffload import cli
from kvoffload.stack import Stack, StackConfig, colocated_threads_env, free_stack_ports
from kvoffload.vllm_stack import (DEFAULT_MAX_MODEL_LEN, VllmStack, split_cores, vllm_decode_transfer_config,
                                  vllm_prefill_transfer_config)

# ---- configs and command lines -----------------------------------------------------------------


def test_the_prefill_transfer_config_is_the_multiconnector_of_the_d2h_producer_and_the_layerwise_store():
    assert json.loads(vllm_prefill_transfer_config("127.0.0.1:5000")) == {
        "kv_connector": "MultiConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_producer",
             "kv_connector_module_path": "kvoffload_vllm",
             "kv_connector_extra_config": {"transfer_backend": "kvoffload"}},
            {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer",
             "kv_connector_module_path": "kvoffload_vllm",
             "kv_connector_extra_config": {"backend": "kvoffload", "use_layerwise": True,
                                           "metastore": "127.0.0.1:5000"}}]}}


def test_the_decode_transfer_config_is_the_d2h_consumer_on_its_control_port():
    assert json.loads(vllm_decode_transfer_config(20050)) == {
        "kv_connector": "SfaRemoteD2HConnector", "kv_role": "kv_consumer", "kv_port": 20050,
        "kv_connector_module_path": "kvoffload_vllm", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"transfer_backend": "kvoffload"}}


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
    for name, port, config in (("prefill-0", cfg.prefill_ports[0],
                                vllm_prefill_transfer_config(f"127.0.0.1:{cfg.metastore_port}")),
                               ("decode-0", cfg.decode_ports[0], vllm_decode_transfer_config(cfg.kv_port))):
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
    assert cmds["proxy"][cmds["proxy"].index("--decoder-ports") + 1:][:2] == [str(p) for p in cfg.decode_ports]


def test_only_the_vllm_children_get_the_vllm_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    stack = VllmStack(_cfg(tmp_path))
    base = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    assert stack.engine_env("prefill-0") == {**base, "VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert stack.engine_env("decode-0") == {**base, "VLLM_CPU_OMP_THREADS_BIND": "2,3"}
    assert stack.engine_env("metastore") == stack.engine_env("proxy") == {}
    reference = Stack(_cfg(tmp_path)).engine_env("prefill-0")  # the reference stack's own thread plan only
    assert not any(k.startswith("VLLM_") for k in reference) and reference == colocated_threads_env(
        "prefill-0", 4, os.environ)
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


# ---- the command line ----------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["up", "demo"])
@pytest.mark.parametrize("flags", [["--tls-cert", "c.pem", "--tls-key", "k.pem"], ["--tls-ca", "ca.pem"]])
def test_reference_only_flags_are_refused_with_the_vllm_engine(command, flags, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--engine", "vllm", "--model", "/nonexistent", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"kvoffload {command}: error: " in err and "only with --engine reference" in err
    assert all(f in err for f in flags if f.startswith("--"))


def test_an_unknown_engine_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["up", "--engine", "sglang"])
    assert exc.value.code == 2 and "invalid choice: 'sglang'" in capsys.readouterr().err


def test_the_vllm_engine_without_vllm_installed_says_how_to_install_it(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--engine", "vllm", "--model", "/nonexistent"])
    assert exc.value.code == 2 and "make install-vllm" in capsys.readouterr().err


def test_max_model_len_defaults_per_engine(tmp_path):
    def cfg(*argv):
        args = cli.build_parser().parse_args(["up", "--model", str(tmp_path), "--log-dir", str(tmp_path), *argv])
        return cli._stack_config(args)

    assert cfg().max_model_len == cli.REFERENCE_MAX_MODEL_LEN == 16384
    assert cfg("--engine", "vllm").max_model_len == cli.VLLM_MAX_MODEL_LEN == DEFAULT_MAX_MODEL_LEN
    assert cfg("--engine", "vllm", "--max-model-len", "1024").max_model_len == 1024
    assert cfg("--engine", "vllm").model == tmp_path and cfg("--engine", "vllm").tls is None


def test_the_reference_engine_is_the_default_and_builds_the_reference_stack(tmp_path):
    args = cli.build_parser().parse_args(["up", "--model", str(tmp_path)])
    assert args.engine == "reference"
    assert type(cli._make_stack(args, cli._stack_config(args))) is Stack
    args = cli.build_parser().parse_args(["up", "--engine", "vllm", "--model", str(tmp_path)])
    assert type(cli._make_stack(args, cli._stack_config(args))) is VllmStack


def test_the_reference_demo_says_its_text_is_meaningless_and_where_real_text_is(tmp_path, monkeypatch, capsys):
    import kvoffload.stack as stack_mod

    class FakeStack:
        def __init__(self, cfg):
            self.url, self.auth_headers = "http://127.0.0.1:1", {}

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    stats = {"device_kv_bytes": 1, "pool_used_bytes": 2, "bytes_read": 3, "read_done": 4, "held_slots": 0}
    monkeypatch.setattr(stack_mod, "Stack", FakeStack)
    monkeypatch.setattr(stack_mod, "ensure_tiny_model", lambda path: tmp_path)
    monkeypatch.setattr(stack_mod, "post_json", lambda *a, **kw: {
        "choices": [{"text": "xq", "token_ids": [1, 2]}], "usage": {"prompt_tokens": 9, "completion_tokens": 2}})
    monkeypatch.setattr(stack_mod, "stack_stats", lambda cfg: {"prefill-0": stats, "decode-0": stats,
                                                               "metastore": {"objects": 1}})
    assert cli.main(["demo", "--log-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "meaningless" in line and "make demo-vllm" in line] == [lines[0]]
    assert json.loads(lines[-1])["completion_tokens"] == 2


def test_the_vllm_demo_prints_the_question_the_answer_and_the_summary(tmp_path, monkeypatch, capsys):
    import kvoffload.vllm_stack as vs

    seen = {}

    def fake_run_demo(cfg, max_tokens):
        seen.update(cfg=cfg, max_tokens=max_tokens)
        return "An answer.", {"prompt_tokens": 300, "completion_tokens": 3, "seconds": 1.0}

    monkeypatch.setattr(vs, "run_demo", fake_run_demo)
    assert cli.main(["demo", "--engine", "vllm", "--model", str(tmp_path), "--log-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert vs.DEMO_QUESTION in out[0] and "'An answer.'" in out[1] and json.loads(out[2])["completion_tokens"] == 3
    assert seen["max_tokens"] == vs.DEFAULT_MAX_TOKENS and seen["cfg"].model == tmp_path
    assert not any("meaningless" in line for line in out)


# ---- the launcher, on fake children ----------------------------------------------------------------

FAKE_SERVICE = textwrap.dedent('''
    import http.server, os, signal, subprocess, sys, time
    name, port, events, delay, code = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
    grandchild = sys.argv[6] == "1"

    def event(*what):
        with open(events, "a") as f:
            f.write(" ".join([name, *map(str, what)]) + "\\n")

    event("spawned", os.environ.get("HF_HUB_OFFLINE"))
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

    def term(*_):
        event("sigterm")
        os._exit(0)  # a grandchild is left behind: stopping the group must end it

    signal.signal(signal.SIGTERM, term)
    event("healthy")
    server.serve_forever()
''')


def fake_stack(base: type[Stack], cfg: StackConfig, script: Path, events: Path, delays: dict, codes: dict,
               grandchildren: bool = True):
    """``base``'s services (names, start order, hooks), each played by FAKE_SERVICE on an HTTP health port
    (with a grandchild that ignores SIGTERM when ``grandchildren``)."""

    class Fake(base):
        stop_grace_s = 1.0  # the grandchildren ignore SIGTERM: SIGKILL after a second

        def commands(self):
            out = []
            for name, _, health in base.commands(self):
                port = int(health.split(":")[2].split("/")[0])
                argv = [sys.executable, str(script), name, str(port), str(events), str(delays.get(name, 0)),
                        str(codes.get(name, 0)), "1" if grandchildren else "0"]
                out.append((name, argv, f"http://127.0.0.1:{port}/"))
            return out

    script.write_text(FAKE_SERVICE)
    return Fake(cfg)


def read_events(events: Path) -> list[tuple[str, ...]]:
    return [tuple(line.split()) for line in events.read_text().splitlines()]


def index(evs, *event) -> int:
    return next(i for i, e in enumerate(evs) if e[:len(event)] == event)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def test_vllm_stack_starts_metastore_first_then_the_rest_and_stops_whole_groups_in_reverse(tmp_path):
    cfg, events = _cfg(tmp_path), tmp_path / "events"
    stack = fake_stack(VllmStack, cfg, tmp_path / "fake.py", events,
                       delays={"metastore": 1.0, "prefill-0": 1.5}, codes={})
    stack.start(timeout_s=60, progress=False)
    try:
        evs = read_events(events)
        # the prefill (its store registers with the metastore) waits for the metastore's health...
        assert index(evs, "prefill-0", "spawned") > index(evs, "metastore", "healthy")
        # ...the decode starts beside the prefill, not after it
        assert index(evs, "decode-0", "spawned") < index(evs, "prefill-0", "healthy")
        names = ["metastore", "prefill-0", "decode-0", "proxy"]
        assert [n for n, _, _ in stack.procs] == names
        assert all((cfg.log_dir / f"{n}.log").exists() for n in names)
        env = {e[0]: e[2] for e in evs if e[1] == "spawned"}
        assert env == {"metastore": "None", "prefill-0": "1", "decode-0": "1", "proxy": "None"}
    finally:
        stack.stop()
    evs = read_events(events)
    assert [e[0] for e in evs if e[1] == "sigterm"] == ["proxy", "decode-0", "prefill-0", "metastore"]
    grandchildren = [int(e[2]) for e in evs if e[1] == "grandchild"]
    assert len(grandchildren) == 4 and not any(pid_alive(p) for p in grandchildren)
    assert stack.procs == []


def test_a_child_that_dies_while_starting_stops_the_others_and_names_itself(tmp_path):
    cfg, events = _cfg(tmp_path), tmp_path / "events"
    stack = fake_stack(VllmStack, cfg, tmp_path / "fake.py", events, delays={}, codes={"decode-0": 3})
    with pytest.raises(RuntimeError, match=r"decode-0 exited with status 3 while starting; its log \("):
        stack.start(timeout_s=60, progress=False)
    evs = read_events(events)
    assert [e[0] for e in evs if e[1] == "sigterm"] == ["proxy", "prefill-0", "metastore"]
    assert not any(pid_alive(int(e[2])) for e in evs if e[1] == "grandchild")
    assert stack.procs == []


def test_the_reference_stack_still_spawns_every_service_at_once(tmp_path):
    cfg, events = _cfg(tmp_path), tmp_path / "events"
    stack = fake_stack(Stack, cfg, tmp_path / "fake.py", events, delays={"metastore": 1.0}, codes={},
                       grandchildren=False)
    t = time.monotonic()
    stack.start(timeout_s=60, progress=False)
    stack.stop()
    evs = read_events(events)
    assert index(evs, "proxy", "spawned") < index(evs, "metastore", "healthy")
    assert [e[0] for e in evs if e[1] == "sigterm"] == ["proxy", "prefill-0", "decode-0", "metastore"]
    assert time.monotonic() - t < 30


# ---- what the demo reports -------------------------------------------------------------------------

def test_the_demo_reads_vllm_and_proxy_counters_by_label():
    from kvoffload.vllm_stack import _delta, _proxy_view, _vllm_view

    def sample(name, value, **labels):
        return (name, tuple(sorted({"engine": "0", "model_name": "m", **labels}.items()))), value

    before = dict([sample("vllm:prompt_tokens_by_source_total", 5.0, source="local_compute"),
                   sample("vllm:prompt_tokens_by_source_total", 0.0, source="external_kv_transfer"),
                   sample("vllm:prompt_tokens_by_source_total", 0.0, source="local_cache_hit"),
                   sample("vllm:generation_tokens_total", 0.0), sample("vllm:request_success_total", 0.0,
                                                                       finished_reason="length")])
    after = dict([sample("vllm:prompt_tokens_by_source_total", 6.0, source="local_compute"),
                  sample("vllm:prompt_tokens_by_source_total", 291.0, source="external_kv_transfer"),
                  sample("vllm:prompt_tokens_by_source_total", 0.0, source="local_cache_hit"),
                  sample("vllm:generation_tokens_total", 8.0), sample("vllm:request_success_total", 1.0,
                                                                      finished_reason="length")])
    assert _vllm_view(_delta(after, before)) == {"prompt_tokens_computed": 1, "prompt_tokens_pulled": 291,
                                                 "prompt_tokens_local_cache_hit": 0, "generation_tokens": 8,
                                                 "requests": 1}
    proxy = {("kvoffload_proxy_requests_total", (("endpoint", "chat"), ("outcome", "ok"))): 1.0,
             ("kvoffload_proxy_requests_total", (("endpoint", "completions"), ("outcome", "ok"))): 0.0,
             ("kvoffload_proxy_metaserver_latency_seconds_count", (("outcome", "ok"),)): 1.0,
             ("kvoffload_proxy_metaserver_latency_seconds_sum", (("outcome", "ok"),)): 0.4567,
             ("kvoffload_proxy_backend_retries_total", (("backend", "http://x"), ("role", "decoder"))): 2.0}
    assert _proxy_view(proxy) == {"requests": {"chat:ok": 1}, "metaserver_registrations": {"ok": 1},
                                  "metaserver_seconds": 0.457, "backend_retries": 2}


def test_the_demo_counts_the_connectors_pull_lines_written_during_the_request(tmp_path):
    from types import SimpleNamespace

    from kvoffload.vllm_stack import _logged_pulls

    log = tmp_path / "decode-0.log"
    log.write_text("2026 [info] kvoffload_d2h_pulled  bytes=999 request_id=old tokens=3\n")
    since = {"decode-0": log.stat().st_size}
    with open(log, "a") as f:
        f.write("2026 [info     ] kvoffload_d2h_pulled           bytes=4096 prefill=127.0.0.1:1 request_id=a tokens=300\n"
                "2026 [warning  ] kvoffload_d2h_load_failed      layers_done=1 reason=\"pull of layer 0 failed\"\n"
                "(EngineCore pid=1) WARNING [scheduler.py:3426] Recovered from KV load failure: 2 request(s) "
                "rescheduled (256 tokens affected).\n")
    stack = SimpleNamespace(procs=[("decode-0", None, log), ("prefill-0", None, tmp_path / "nope.log")])
    assert _logged_pulls(stack, since) == {"decode-0": {"pulls_logged": 1, "bytes_pulled": 4096,
                                                        "pull_failures_logged": 1,
                                                        "load_failures_recovered_by_vllm": 2}}


def _vllm_metrics(without: tuple[str, dict] | None = None):
    """A fresh vLLM server's /metrics as the summary reads it: vLLM creates every prompt-token
    source's and every finish reason's series at start-up (``without``: one of them left out)."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from kvoffload.prom import Metrics

    reg, base = CollectorRegistry(), {"model_name": "m", "engine": "0"}
    series = [("vllm:prompt_tokens_by_source", {"source": s}) for s in ("local_compute", "local_cache_hit",
                                                                        "external_kv_transfer")]
    series += [("vllm:generation_tokens", {}), ("vllm:request_success", {"finished_reason": "length"}),
               ("vllm:request_success", {"finished_reason": "stop"})]
    counters = {}
    for name, labels in series:
        if without and f"{name}_total" == without[0] and without[1].items() <= labels.items():
            continue
        if name not in counters:
            counters[name] = Counter(name, name, [*base, *labels], registry=reg)
        counters[name].labels(**base, **labels)
    return Metrics.parse(generate_latest(reg).decode(), source="decode-0/metrics")


def test_a_vllm_series_the_summary_reads_that_the_server_lacks_is_an_error_not_a_zero():
    from kvoffload.prom import MissingMetric
    from kvoffload.vllm_stack import _VLLM_SERIES, _counters, _delta, _vllm_view

    full = _counters(_vllm_metrics(), proxy=False)
    assert _vllm_view(_delta(full, full)) == {"prompt_tokens_computed": 0, "prompt_tokens_pulled": 0,
                                              "prompt_tokens_local_cache_hit": 0, "generation_tokens": 0,
                                              "requests": 0}
    for name, labels in _VLLM_SERIES:
        with pytest.raises(MissingMetric, match=name) as err:
            _counters(_vllm_metrics(without=(name, labels)), proxy=False)
        assert all(v in str(err.value) for v in labels.values()), err.value
        lacking = {k: v for k, v in full.items() if not (k[0] == name and labels.items() <= dict(k[1]).items())}
        with pytest.raises(MissingMetric, match=name):  # the view too: "0 tokens computed" is not read off nothing
            _vllm_view(_delta(lacking, lacking))


def test_the_proxy_must_declare_every_counter_the_summary_reads():
    """A fresh proxy has no series of its labelled counters yet (0 retries is then true); a proxy
    that does not export one of them at all makes its summary an error."""
    from kvoffload.prom import Metrics, MissingMetric
    from kvoffload.tests.test_prom import _proxy_text
    from kvoffload.vllm_stack import _PROXY_METRICS, _counters, _proxy_view

    text = _proxy_text()
    assert _proxy_view(_counters(Metrics.parse(text), proxy=True)) == {
        "requests": {}, "metaserver_registrations": {}, "metaserver_seconds": 0, "backend_retries": 0}
    for name in _PROXY_METRICS:
        family = name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
        kept = "\n".join(line for line in text.splitlines() if family not in line) + "\n"
        with pytest.raises(MissingMetric, match=name):
            _counters(Metrics.parse(kept, source="proxy/metrics"), proxy=True)


def test_a_server_lacking_what_the_summary_reads_gets_an_error_in_the_summary(monkeypatch):
    from types import SimpleNamespace

    from kvoffload import vllm_stack as vs
    from kvoffload.prom import Metrics
    from kvoffload.tests.test_prom import _proxy_text

    cfg = SimpleNamespace(host="h", prefill_ports=(1,), decode_ports=(2,))
    stack = SimpleNamespace(cfg=cfg, url="http://h:3", auth_headers={})
    scrapes = {"http://h:1": _vllm_metrics(), "http://h:3": Metrics.parse(_proxy_text()),
               "http://h:2": _vllm_metrics(without=("vllm:prompt_tokens_by_source_total",
                                                    {"source": "external_kv_transfer"}))}
    monkeypatch.setattr(vs, "scrape", lambda url, headers=None: scrapes[url])
    out = vs._scrape_all(stack)
    assert isinstance(out["prefill-0"], dict) and isinstance(out["proxy"], dict)
    assert "external_kv_transfer" in out["decode-0"] and "lacks" in out["decode-0"], out["decode-0"]
