"""What ``kvoffload demo --engine vllm`` reports, without vLLM running: vLLM's and the proxy's counters
read by label (a series the summary reads that a server lacks is an error, never a zero), and the
connectors' pull lines counted in the decode's log."""

from __future__ import annotations

import pytest


def test_the_demo_reads_vllm_and_proxy_counters_by_label():
    from kvoffload_testing.vllm_demo import _delta, _proxy_view, _vllm_view

    def sample(name, value, **labels):
        return (name, tuple(sorted({"engine": "0", "model_name": "m", **labels}.items()))), value

    before = dict(
        [
            sample("vllm:prompt_tokens_by_source_total", 5.0, source="local_compute"),
            sample("vllm:prompt_tokens_by_source_total", 0.0, source="external_kv_transfer"),
            sample("vllm:prompt_tokens_by_source_total", 0.0, source="local_cache_hit"),
            sample("vllm:generation_tokens_total", 0.0),
            sample("vllm:request_success_total", 0.0, finished_reason="length"),
        ]
    )
    after = dict(
        [
            sample("vllm:prompt_tokens_by_source_total", 6.0, source="local_compute"),
            sample("vllm:prompt_tokens_by_source_total", 291.0, source="external_kv_transfer"),
            sample("vllm:prompt_tokens_by_source_total", 0.0, source="local_cache_hit"),
            sample("vllm:generation_tokens_total", 8.0),
            sample("vllm:request_success_total", 1.0, finished_reason="length"),
        ]
    )
    assert _vllm_view(_delta(after, before)) == {
        "prompt_tokens_computed": 1,
        "prompt_tokens_pulled": 291,
        "prompt_tokens_local_cache_hit": 0,
        "generation_tokens": 8,
        "requests": 1,
    }
    proxy = {
        ("kvoffload_proxy_requests_total", (("endpoint", "chat"), ("outcome", "ok"))): 1.0,
        ("kvoffload_proxy_requests_total", (("endpoint", "completions"), ("outcome", "ok"))): 0.0,
        ("kvoffload_proxy_metaserver_latency_seconds_count", (("outcome", "ok"),)): 1.0,
        ("kvoffload_proxy_metaserver_latency_seconds_sum", (("outcome", "ok"),)): 0.4567,
        ("kvoffload_proxy_backend_retries_total", (("backend", "http://x"), ("role", "decoder"))): 2.0,
    }
    assert _proxy_view(proxy) == {
        "requests": {"chat:ok": 1},
        "metaserver_registrations": {"ok": 1},
        "metaserver_seconds": 0.457,
        "backend_retries": 2,
    }


def test_the_demo_counts_the_connectors_pull_lines_written_during_the_request(tmp_path):
    from types import SimpleNamespace

    from kvoffload_testing.vllm_demo import _logged_pulls

    log = tmp_path / "decode-0.log"
    log.write_text("2026 [info] kvoffload_d2h_pulled  bytes=999 request_id=old tokens=3\n")
    since = {"decode-0": log.stat().st_size}
    with open(log, "a") as f:
        f.write(
            "2026 [info     ] kvoffload_d2h_pulled           bytes=4096 prefill=127.0.0.1:1 request_id=a tokens=300\n"
            '2026 [warning  ] kvoffload_d2h_load_failed      layers_done=1 reason="pull of layer 0 failed"\n'
            "(EngineCore pid=1) WARNING [scheduler.py:3426] Recovered from KV load failure: 2 request(s) "
            "rescheduled (256 tokens affected).\n"
        )
    stack = SimpleNamespace(
        services=[
            SimpleNamespace(name="decode-0", log_path=log),
            SimpleNamespace(name="prefill-0", log_path=tmp_path / "nope.log"),
        ]
    )
    assert _logged_pulls(stack, since) == {
        "decode-0": {
            "pulls_logged": 1,
            "bytes_pulled": 4096,
            "pull_failures_logged": 1,
            "load_failures_recovered_by_vllm": 2,
        }
    }


def _vllm_metrics(without: tuple[str, dict] | None = None):
    """A fresh vLLM server's /metrics as the summary reads it: vLLM creates every prompt-token
    source's and every finish reason's series at start-up (``without``: one of them left out)."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from kvoffload_testing.prom import Metrics

    reg, base = CollectorRegistry(), {"model_name": "m", "engine": "0"}
    series = [
        ("vllm:prompt_tokens_by_source", {"source": s})
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    ]
    series += [
        ("vllm:generation_tokens", {}),
        ("vllm:request_success", {"finished_reason": "length"}),
        ("vllm:request_success", {"finished_reason": "stop"}),
    ]
    counters = {}
    for name, labels in series:
        if without and f"{name}_total" == without[0] and without[1].items() <= labels.items():
            continue
        if name not in counters:
            counters[name] = Counter(name, name, [*base, *labels], registry=reg)
        counters[name].labels(**base, **labels)
    return Metrics.parse(generate_latest(reg).decode(), source="decode-0/metrics")


def test_a_vllm_series_the_summary_reads_that_the_server_lacks_is_an_error_not_a_zero():
    from kvoffload_testing.prom import MissingMetric
    from kvoffload_testing.vllm_demo import _VLLM_SERIES, _counters, _delta, _vllm_view

    full = _counters(_vllm_metrics(), proxy=False)
    assert _vllm_view(_delta(full, full)) == {
        "prompt_tokens_computed": 0,
        "prompt_tokens_pulled": 0,
        "prompt_tokens_local_cache_hit": 0,
        "generation_tokens": 0,
        "requests": 0,
    }
    for name, labels in _VLLM_SERIES:
        with pytest.raises(MissingMetric, match=name) as err:
            _counters(_vllm_metrics(without=(name, labels)), proxy=False)
        assert all(v in str(err.value) for v in labels.values()), err.value
        lacking = {k: v for k, v in full.items() if not (k[0] == name and labels.items() <= dict(k[1]).items())}
        with pytest.raises(MissingMetric, match=name):  # the view too: "0 tokens computed" is not read off nothing
            _vllm_view(_delta(lacking, lacking))


def test_the_proxy_must_declare_every_counter_the_summary_reads(proxy_text):
    """A fresh proxy has no series of its labelled counters yet (0 retries is then true); a proxy
    that does not export one of them at all makes its summary an error."""
    from kvoffload_testing.prom import Metrics, MissingMetric
    from kvoffload_testing.vllm_demo import _PROXY_METRICS, _counters, _proxy_view

    text = proxy_text
    assert _proxy_view(_counters(Metrics.parse(text), proxy=True)) == {
        "requests": {},
        "metaserver_registrations": {},
        "metaserver_seconds": 0,
        "backend_retries": 0,
    }
    for name in _PROXY_METRICS:
        family = name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
        kept = "\n".join(line for line in text.splitlines() if family not in line) + "\n"
        with pytest.raises(MissingMetric, match=name):
            _counters(Metrics.parse(kept, source="proxy/metrics"), proxy=True)


def test_a_server_lacking_what_the_summary_reads_gets_an_error_in_the_summary(monkeypatch, proxy_text):
    from types import SimpleNamespace

    from kvoffload_testing import vllm_demo as vs
    from kvoffload_testing.prom import Metrics

    cfg = SimpleNamespace(host="h", prefill_ports=(1,), decode_ports=(2,))
    urls = {"prefill-0": "http://h:1", "decode-0": "http://h:2"}  # where each server's health check reaches it
    stack = SimpleNamespace(cfg=cfg, url="http://h:3", auth_headers={}, http_url=urls.__getitem__)
    scrapes = {
        "http://h:1": _vllm_metrics(),
        "http://h:3": Metrics.parse(proxy_text),
        "http://h:2": _vllm_metrics(without=("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"})),
    }
    monkeypatch.setattr(vs, "scrape", lambda url, headers=None: scrapes[url])
    out = vs._scrape_all(stack)
    assert isinstance(out["prefill-0"], dict) and isinstance(out["proxy"], dict)
    assert "external_kv_transfer" in out["decode-0"] and "lacks" in out["decode-0"], out["decode-0"]
