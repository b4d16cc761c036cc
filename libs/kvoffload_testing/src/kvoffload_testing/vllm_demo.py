"""``kvoffload demo --engine vllm``: one chat request through a running :class:`VllmStack` and a
summary of it as the client, each vLLM server's /metrics, the D2H connector's log lines and the proxy
measured it (counter deltas of settled scrapes; a server whose metrics cannot be read gets an error).
"""

from __future__ import annotations

import re
import time

from kvoffload_testing.prom import Metrics, MissingMetric, scrape
from kvoffload_testing.stack import StackConfig
from kvoffload_testing.stack_client import post_json
from kvoffload_testing.vllm_stack import VllmStack

DEFAULT_MAX_TOKENS = 64

DEMO_CONTEXT = (
    "kvoffload serves large language models with almost no key-value cache in accelerator memory. "
    "A request first reaches the proxy, which sends it to a decode server. The decode server reserves "
    "host memory for the prompt and tells the proxy where it can be reached. The proxy then sends the "
    "same prompt to a prefill server. The prefill server computes the prompt layer by layer. After each "
    "layer, it saves the layer's keys and values to a host memory pool, and the decode server copies "
    "that layer out of the prefill server's buffer while the next layer is still being computed. When "
    "the last layer is done, the prefill server sends the first token to the decode server, which "
    "generates the rest of the answer and streams it back through the proxy. A metastore keeps an "
    "index of every block in the host memory pools, so a later request that starts with the same text "
    "can load those blocks instead of computing them again. Every service reports its health, and "
    "every request either finishes with its tokens or fails with an error that names the server and "
    "the stage where it failed. Nothing a request held is left behind: its buffers, its pool blocks "
    "and its leases are released in every case."
)
DEMO_QUESTION = "In two sentences, how does a request travel from the prefill server to the decode server?"


# the /metrics samples the summary reads (counters only: a scrape equals the last one once a request settled)
_COUNTERS = frozenset(
    {
        "vllm:prompt_tokens_by_source_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "kvoffload_proxy_requests_total",
        "kvoffload_proxy_metaserver_latency_seconds_count",
        "kvoffload_proxy_metaserver_latency_seconds_sum",
        "kvoffload_proxy_backend_retries_total",
    }
)
# What each server must export, checked on every scrape: a missing one makes that server's summary
# an error naming it, never a 0 that passes "no prompt token computed" or "nothing retried". vLLM
# creates each series the summary reads at start-up (every prompt-token source, every finish
# reason), so those samples must be there; the proxy's counters are labelled by endpoint, outcome
# and backend and get a series on first use, so of those the metric itself must be declared.
_VLLM_SERIES: tuple[tuple[str, dict[str, str]], ...] = (
    ("vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    ("vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    ("vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    ("vllm:generation_tokens_total", {}),
    ("vllm:request_success_total", {}),
)
_PROXY_METRICS = (
    "kvoffload_proxy_requests_total",
    "kvoffload_proxy_metaserver_latency_seconds_count",
    "kvoffload_proxy_metaserver_latency_seconds_sum",
    "kvoffload_proxy_backend_retries_total",
)


def _counters(metrics: Metrics, proxy: bool) -> dict[tuple[str, tuple], float]:
    """The ``_COUNTERS`` samples of one scrape, (name, sorted labels) -> value, once every series
    the summary reads is there (``MissingMetric`` naming the first one that is not)."""
    if proxy:
        undeclared = [n for n in _PROXY_METRICS if not metrics.declares(n)]
        if undeclared:
            raise MissingMetric(f"{metrics.source}: the proxy does not export {', '.join(undeclared)}")
    else:
        for name, labels in _VLLM_SERIES:
            metrics.values(name, **labels)
    return {k: v for k, v in metrics.samples.items() if k[0] in _COUNTERS}


def _scrape(url: str, headers: dict[str, str] | None = None, proxy: bool = False) -> dict[tuple[str, tuple], float]:
    """The ``_COUNTERS`` samples of ``GET url/metrics`` (``_counters``)."""
    return _counters(scrape(url, headers), proxy)


def _total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of sample ``name`` over the label sets that have ``labels`` (0 for none: a proxy
    counter with no series yet; ``_counters`` checked that the metric exists)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def _series(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """``_total`` of a series that must be there (vLLM's: created at start-up): ``MissingMetric``
    when it is not."""
    want = set(labels.items())
    if not any(n == name and want <= set(ls) for n, ls in samples):
        raise MissingMetric(f"no sample {name} with labels {labels} among {sorted({n for n, _ in samples})}")
    return _total(samples, name, **labels)


def _delta(after: dict, before: dict) -> dict:
    """``after`` minus ``before`` per series; a series ``before`` lacks started at 0 (a proxy series
    created by its first increment: vLLM's and the proxy's metrics themselves were checked there)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _vllm_view(d: dict) -> dict:
    """What one vLLM server did, from its /metrics: prompt tokens by where their KV came from."""
    return {
        "prompt_tokens_computed": int(_series(d, "vllm:prompt_tokens_by_source_total", source="local_compute")),
        "prompt_tokens_pulled": int(_series(d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")),
        "prompt_tokens_local_cache_hit": int(
            _series(d, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
        ),
        "generation_tokens": int(_series(d, "vllm:generation_tokens_total")),
        "requests": int(_series(d, "vllm:request_success_total")),
    }


def _proxy_view(d: dict) -> dict:
    """What the proxy saw, from its /metrics: requests by outcome, decoders' registrations, retries."""
    requests, registrations = {}, {}
    for (name, labels), value in d.items():
        ls = dict(labels)
        if name == "kvoffload_proxy_requests_total" and value:
            requests[f"{ls.get('endpoint')}:{ls.get('outcome')}"] = int(value)
        elif name == "kvoffload_proxy_metaserver_latency_seconds_count" and value:
            registrations[ls.get("outcome")] = int(value)
    return {
        "requests": requests,
        "metaserver_registrations": registrations,
        "metaserver_seconds": round(_total(d, "kvoffload_proxy_metaserver_latency_seconds_sum"), 3),
        "backend_retries": int(_total(d, "kvoffload_proxy_backend_retries_total")),
    }


# the D2H consumer's lines (kvoffload_vllm.d2h_consumer): a request whose every layer landed, one whose pull failed
_PULLED = re.compile(r"kvoffload_d2h_pulled\b.*?\bbytes=(\d+)")
_PULL_FAILED = re.compile(r"kvoffload_d2h_load_failed\b")
# vLLM's own line when loads reported as invalid blocks were recomputed ("kv_load_failure_policy": "recompute")
_RECOVERED = re.compile(r"Recovered from KV load failure: (\d+) request\(s\) rescheduled")


def _log_sizes(stack: VllmStack) -> dict[str, int]:
    return {s.name: s.log_path.stat().st_size for s in stack.services}


def _logged_pulls(stack: VllmStack, since: dict[str, int]) -> dict[str, dict]:
    """Per decode, what its log says since ``since`` (log sizes): the pulls the connector finished
    (and their bytes) and those that failed (vLLM recomputes those: never attended over)."""
    out = {}
    for service in stack.services:
        name = service.name
        if name.startswith("decode-"):
            with open(service.log_path, "rb") as f:
                f.seek(since.get(name, 0))
                text = f.read().decode(errors="replace")
            pulled = _PULLED.findall(text)
            out[name] = {
                "pulls_logged": len(pulled),
                "bytes_pulled": sum(int(b) for b in pulled),
                "pull_failures_logged": len(_PULL_FAILED.findall(text)),
                "load_failures_recovered_by_vllm": sum(int(r) for r in _RECOVERED.findall(text)),
            }
    return out


def _scrape_all(stack: VllmStack) -> dict[str, dict | str]:
    """Every server's ``_COUNTERS``, or why they could not be read (a server that died, or one that
    does not export a series the summary reads: that server's summary is then that error)."""
    c = stack.cfg
    urls = {
        **{f"prefill-{i}": stack.http_url(f"prefill-{i}") for i in range(len(c.prefill_ports))},
        **{f"decode-{i}": stack.http_url(f"decode-{i}") for i in range(len(c.decode_ports))},
        "proxy": stack.url,
    }
    out: dict[str, dict | str] = {}
    for name, url in urls.items():
        try:
            out[name] = _scrape(url, stack.auth_headers if name == "proxy" else None, proxy=name == "proxy")
        except OSError as exc:
            out[name] = f"/metrics unreadable: {exc}"
        except MissingMetric as exc:
            out[name] = f"/metrics lacks what the summary reads: {exc}"
    return out


def _settled(stack: VllmStack, timeout_s: float = 5.0, since: dict | None = None) -> dict[str, dict | str]:
    """The metrics once two scrapes 0.5 s apart agree (a server may record a step's counters just
    after it answered), or the last scrape after ``timeout_s``. With ``since`` (an earlier scrape),
    also not before a prefill and a decode server each counted one more finished request than
    then: a vLLM decode can answer before its prefill server has (it needs only the pulled layers),
    and that server's counters move only once it answered the proxy."""

    def finished(now: dict) -> bool:
        if since is None:
            return True
        done = {"prefill-": 0.0, "decode-": 0.0}
        for name, samples in now.items():
            role = next((r for r in done if name.startswith(r)), None)
            was = since.get(name)
            if role is None or isinstance(samples, str) or isinstance(was, str):
                continue
            done[role] += _total(samples, "vllm:request_success_total") - _total(
                was or {}, "vllm:request_success_total"
            )
        return all(v >= 1 for v in done.values())

    deadline, last = time.monotonic() + timeout_s, _scrape_all(stack)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = _scrape_all(stack)
        if now == last and finished(now):
            break
        last = now
    return last


def demo(stack: VllmStack, max_tokens: int = DEFAULT_MAX_TOKENS, timeout_s: float = 300.0) -> tuple[str, dict]:
    """One chat request through the running stack's proxy: (the answer's text, a summary of the
    request as the client, the vLLM servers, the connector's log and the proxy measured it)."""
    before, logs_before = _settled(stack, timeout_s=1.0), _log_sizes(stack)
    messages = [{"role": "user", "content": f"{DEMO_CONTEXT}\n\n{DEMO_QUESTION}"}]
    t = time.monotonic()
    answer = post_json(
        f"{stack.url}/v1/chat/completions",
        {"messages": messages, "max_tokens": max_tokens, "temperature": 0},
        timeout_s=timeout_s,
        headers=stack.auth_headers,
    )
    elapsed = time.monotonic() - t
    after = _settled(stack, timeout_s=30.0, since=before)
    logged = _logged_pulls(stack, logs_before)
    views = {}
    for name, now in after.items():
        was = before.get(name)
        if isinstance(now, str) or isinstance(was, str):
            views[name] = {"error": now if isinstance(now, str) else was}
        else:
            d = _delta(now, was or {})
            views[name] = _proxy_view(d) if name == "proxy" else _vllm_view(d)
        views[name].update(logged.get(name, {}))
    summary = {
        "engine": "vllm",
        "model": str(stack.cfg.model),
        "prompt_tokens": answer["usage"]["prompt_tokens"],
        "completion_tokens": answer["usage"]["completion_tokens"],
        "finish_reason": answer["choices"][0].get("finish_reason"),
        "seconds": round(elapsed, 3),
        **views,
    }
    return answer["choices"][0]["message"]["content"] or "", summary


def run_demo(cfg: StackConfig, max_tokens: int = DEFAULT_MAX_TOKENS, progress: bool = True) -> tuple[str, dict]:
    """Start the stack, :func:`demo`, stop it."""
    stack = VllmStack(cfg)
    stack.start(progress=progress)
    try:
        return demo(stack, max_tokens)
    finally:
        stack.stop()
