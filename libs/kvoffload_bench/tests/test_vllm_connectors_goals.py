"""``kvoffload bench vllm`` meets its goals only when the decode pulled the prompts' KV: a P/D run whose
every pull failed (the decode recomputed the prompt, and its tokens are still right) meets neither
``pd_requests_pulled`` nor ``pd_requests_failed``.

``run`` is driven end to end with the servers replaced (no vLLM starts): each stream answers at
once, and the counters the bench reads from the servers' ``/metrics`` are kept here, moved by the
streams as the real servers would move them."""

from __future__ import annotations

import collections
import json

import pytest

from kvoffload_bench import vllm_connectors as bench_vllm

HITS = "vllm:external_prefix_cache_hits_total"


class _Service:
    """A vLLM server, metastore or proxy: its address only."""

    def __init__(self, *args, port: int | None = None, **kw) -> None:
        self.port = port or (args[0] if args and isinstance(args[0], int) else 1)
        self.url, self.address = f"http://127.0.0.1:{self.port}", f"127.0.0.1:{self.port}"

    def start(self) -> _Service:
        return self

    def stop(self) -> None:
        return None

    def __enter__(self) -> _Service:
        return self

    def __exit__(self, *exc) -> None:
        return None


class _Proxy(_Service):
    urls: set[str] = set()

    def __init__(self, port: int, prefill_port: int, decode_port: int, log_path) -> None:
        super().__init__(port=port)
        self.urls.add(self.url)


@pytest.fixture
def servers(tmp_path, monkeypatch):
    """Replaces the servers; returns the counter a P/D request moves on the decode ("requests_pulled"
    or "requests_failed") as a one-entry dict, and the model directory."""
    import kvoffload_testing.vllm_server

    metrics: collections.Counter = collections.Counter()
    seen: set[tuple[int, ...]] = set()
    pd_outcome = {"counter": "requests_pulled"}

    def stream(url: str, model: str, prompt: list[int], max_tokens: int):
        if url in _Proxy.urls:  # the decode pulls the prompt's KV (or fails to)
            metrics[bench_vllm.CONSUMER.format(pd_outcome["counter"])] += 1
            metrics[bench_vllm.CONSUMER.format("bytes_read")] += 1000 * (pd_outcome["counter"] == "requests_pulled")
        hit = tuple(prompt) in seen  # the store part's second send of a prompt loads it from the pool
        seen.add(tuple(prompt))
        metrics[HITS] += hit * (len(prompt) // bench_vllm.BLOCK_SIZE) * bench_vllm.BLOCK_SIZE
        ttft = 0.1 if hit else 1.0
        return ttft, ["a", "b", "c", "d"], [ttft + 0.01 * i for i in range(4)]

    monkeypatch.setattr(kvoffload_testing.vllm_server, "VllmServer", _Service)
    monkeypatch.setattr(kvoffload_testing.vllm_server, "Metastore", _Service)
    monkeypatch.setattr(kvoffload_testing.vllm_server, "Proxy", _Proxy)
    monkeypatch.setattr(bench_vllm, "_stream", stream)
    monkeypatch.setattr(bench_vllm, "metric", lambda url, name: metrics[name])
    monkeypatch.setattr(bench_vllm, "_settled", lambda url, names: {n: metrics[n] for n in names})
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 2})
    )
    return pd_outcome, model


def _run(model) -> dict:
    return bench_vllm.run(
        model=str(model),
        prefix_tokens=256,
        rounds=2,
        max_tokens=4,
        pd_prompt_tokens=200,
        pd_max_tokens=4,
        progress=False,
    )


def test_goals_are_not_met_when_every_pull_failed_and_the_decode_recomputed(servers):
    pd_outcome, model = servers
    pd_outcome["counter"] = "requests_failed"
    r = _run(model)
    assert r["tokens_equal"] is True and r["goals_met"]["tokens_equal"] is True  # recomputing gives the tokens
    assert (r["pd_requests_pulled"], r["pd_requests_failed"]) == (0, 2)
    assert r["goals_met"]["pd_requests_pulled"] is False and r["goals_met"]["pd_requests_failed"] is False
    assert r["pd_bytes_pulled_per_request"] is None  # nothing pulled: no bytes per pulled request


def test_goals_are_met_when_every_p_d_request_pulled_its_kv(servers):
    _, model = servers
    r = _run(model)
    assert (r["pd_requests_pulled"], r["pd_requests_failed"]) == (2, 0)
    assert r["goals"]["pd_requests_pulled"] == 2 and r["goals"]["pd_requests_failed"] == 0
    assert set(r["goals"]) == set(r["goals_met"])
    assert all(r["goals_met"].values()), r["goals_met"]
    assert r["not_measured"] == {} and r["pd_bytes_pulled_per_request"] == 1000
