"""``kvoffload bench vllm`` meets its goals only when the decode pulled the prompts' KV: a P/D run whose
every pull failed (the decode recomputed the prompt, and its tokens are still right) meets neither
``pd_requests_pulled`` nor ``pd_requests_failed``.

``run`` is driven end to end with the servers replaced (no vLLM starts): each stream answers at
once, and the counters the bench reads from the servers' ``/metrics`` are kept here (each P/D
decode's its own, its reads counted as its backend's), moved by the streams as the real servers
would move them. The P/D prefill logs a plan of 4 buffers for 30 layers
and holds ``SHARED_CAPACITY`` times the plain server's tokens."""

from __future__ import annotations

import collections
import json

import pytest

from kvoffload_bench import vllm_backends, vllm_pd, vllm_shared, vllm_stream
from kvoffload_bench import vllm_connectors as bench_vllm

HITS = "vllm:external_prefix_cache_hits_total"
PLAIN_CAPACITY = 23_296
SHARED_CAPACITY = {"ratio": 7.5}  # the prefill's capacity over the plain server's (a test may change it)


class _Service:
    """A vLLM server, metastore or proxy: its address only."""

    prefill_urls: set[str] = set()
    by_url: dict[str, _Service] = {}

    def __init__(self, *args, port: int | None = None, log_path=None, **kw) -> None:
        self.port = port or (args[0] if args and isinstance(args[0], int) else 1)
        self.url, self.address = f"http://127.0.0.1:{self.port}", f"127.0.0.1:{self.port}"
        self.log_name = log_path.name if log_path is not None else ""
        self.prefill = self.log_name.endswith("prefill.log")  # each P/D pair's: "<backend>-prefill.log"
        if self.prefill:
            self.prefill_urls.add(self.url)
        self.by_url[self.url] = self

    def log_text(self) -> str:
        return (
            "kvoffload_shared_buffers block_bytes_per_buffer=1 buffers=4 layers=30 num_blocks=1" if self.prefill else ""
        )

    def start(self) -> _Service:
        return self

    def stop(self) -> None:
        return None

    def __enter__(self) -> _Service:
        return self

    def __exit__(self, *exc) -> None:
        return None


class _Proxy(_Service):
    decode_of: dict[str, str] = {}  # proxy URL -> its decode's URL

    def __init__(self, port: int, prefill_port: int, decode_port: int, log_path) -> None:
        super().__init__(port=port)
        self.decode_of[self.url] = f"http://127.0.0.1:{decode_port}"


@pytest.fixture
def servers(tmp_path, monkeypatch):
    """Replaces the servers; returns the counter a P/D request moves on the decode ("requests_pulled"
    or "requests_failed") as a one-entry dict, and the model directory."""
    import kvoffload_testing.vllm_server

    metrics: collections.Counter = collections.Counter()  # the store server's and the plain server's
    decodes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # each decode's own
    seen: set[tuple[int, ...]] = set()
    pd_outcome = {"counter": "requests_pulled"}
    consumer = vllm_backends.CONSUMER.format

    def stream(url: str, model: str, prompt: list[int], max_tokens: int):
        if url in _Proxy.decode_of:  # the decode pulls the prompt's KV (or fails to), through its backend
            decode = _Proxy.decode_of[url]
            pulled = pd_outcome["counter"] == "requests_pulled"
            engine = _Service.by_url[decode].log_name.startswith("mooncake")
            counts = decodes[decode]
            counts[consumer(pd_outcome["counter"])] += 1
            counts[consumer("bytes_read")] += 1000 * pulled
            counts[consumer("read_ms_total")] += 1e-6 * pulled  # 1 ns: far faster than any memcpy
            counts[consumer("reads_engine" if engine else "reads_streamed")] += 30 * pulled
        hit = tuple(prompt) in seen  # the store part's second send of a prompt loads it from the pool
        seen.add(tuple(prompt))
        metrics[HITS] += hit * (len(prompt) // vllm_pd.BLOCK_SIZE) * vllm_pd.BLOCK_SIZE
        ttft = 0.1 if hit else 1.0
        return ttft, ["a", "b", "c", "d"], [ttft + 0.01 * i for i in range(4)]

    monkeypatch.setattr(kvoffload_testing.vllm_server, "VllmServer", _Service)
    monkeypatch.setattr(kvoffload_testing.vllm_server, "Metastore", _Service)
    monkeypatch.setattr(kvoffload_testing.vllm_server, "Proxy", _Proxy)

    def metric(url: str, name: str) -> float:
        return decodes[url][name] if name.startswith("vllm:kvoffload_d2h_consumer_") else metrics[name]

    for module in (bench_vllm, vllm_pd, vllm_stream):
        monkeypatch.setattr(module, "stream", stream)
    for module in (vllm_pd, vllm_stream, vllm_backends):
        monkeypatch.setattr(module, "settled", lambda url, names: {n: metric(url, n) for n in names})
    monkeypatch.setattr(bench_vllm, "metric", metric)

    def matrix(url: str, model: str, lengths: tuple[int, ...]) -> dict:
        """The equality matrix's answers: the proxy's differ in one case where the test asks."""
        out = {f"completion-{n}": (["a", "b"], [-0.5, -0.25]) for n in lengths}
        if url in _Proxy.decode_of and pd_outcome.get("matrix") == "differs":
            out[f"completion-{lengths[-1]}"] = (["a", "c"], [-0.5, -0.25])
        return out

    monkeypatch.setattr(bench_vllm.pd_matrix, "answers", matrix)
    monkeypatch.setattr(
        vllm_shared,
        "capacity_tokens",
        lambda url: int(PLAIN_CAPACITY * (SHARED_CAPACITY["ratio"] if url in _Service.prefill_urls else 1)),
    )
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "num_key_value_heads": 2})
    )
    return pd_outcome, model


def _run(model, **kw) -> dict:
    return bench_vllm.run(
        model=str(model),
        prefix_tokens=256,
        rounds=2,
        max_tokens=4,
        pd_prompt_tokens=200,
        pd_max_tokens=4,
        progress=False,
        **kw,
    )


def test_goals_are_not_met_when_every_pull_failed_and_the_decode_recomputed(servers):
    pd_outcome, model = servers
    pd_outcome["counter"] = "requests_failed"
    r = _run(model)
    assert r["tokens_equal"] is True and r["goals_met"]["tokens_equal"] is True  # recomputing gives the tokens
    assert (r["pd_requests_pulled"], r["pd_requests_failed"]) == (0, 2)
    assert r["goals_met"]["pd_requests_pulled"] is False and r["goals_met"]["pd_requests_failed"] is False
    assert r["pd_bytes_pulled_per_request"] is None  # nothing pulled: no bytes per pulled request
    mooncake = r["pull_by_backend"]["mooncake"]  # no read went through the engine: no rate, goal not met
    assert not mooncake["path_checked"] and mooncake["ratio_to_memcpy"] is None
    assert r["goals_met"]["pull_by_backend.mooncake.ratio_to_memcpy"] is False
    assert "pull_by_backend.mooncake.ratio_to_memcpy" in r["not_measured"]


def test_goals_are_met_when_every_p_d_request_pulled_its_kv(servers):
    _, model = servers
    r = _run(model)
    assert (r["pd_requests_pulled"], r["pd_requests_failed"]) == (2, 0)
    assert r["goals"]["pd_requests_pulled"] == 2 and r["goals"]["pd_requests_failed"] == 0
    assert set(r["goals"]) == set(r["goals_met"])
    assert all(r["goals_met"].values()), r["goals_met"]
    assert r["pd_matrix_mismatches"] == []
    assert r["not_measured"] == {} and r["pd_bytes_pulled_per_request"] == 1000
    by = r["pull_by_backend"]  # each pair's reads went its own way, 30 per request
    assert {name: (p["path_checked"], p["reads"]) for name, p in by.items()} == {
        "grpc_stream": (True, 60),
        "mooncake": (True, 60),
    }


def test_a_run_of_the_grpc_pair_alone_meets_no_mooncake_goal_and_says_why(servers):
    _, model = servers
    r = _run(model, backends=("grpc_stream",))
    assert set(r["pull_by_backend"]) == {"grpc_stream"} and r["pull_by_backend"]["grpc_stream"]["reads"] == 60
    assert r["goals_met"]["pd_requests_pulled"] is True and r["goals_met"]["tokens_equal_by_backend"] is True
    for key in ("ratio_to_memcpy", "pd_tpot_ratio"):
        assert r["goals_met"][f"pull_by_backend.mooncake.{key}"] is False
        assert "not run" in r["not_measured"][f"pull_by_backend.mooncake.{key}"]
    with pytest.raises(ValueError, match="backends: expected grpc_stream"):
        _run(model, backends=("mooncake",))


def test_goals_are_not_met_when_one_matrix_answer_differs_through_p_d(servers):
    pd_outcome, model = servers
    pd_outcome["matrix"] = "differs"
    r = _run(model)
    assert r["goals_met"]["pd_matrix_tokens_equal"] is False
    assert len(r["pd_matrix_mismatches"]) == 1 and "tokens" in r["pd_matrix_mismatches"][0], r["pd_matrix_mismatches"]


def test_the_shared_buffer_goals_fail_when_the_prefill_holds_no_more_than_a_plain_server(servers, monkeypatch):
    _, model = servers
    r = _run(model)
    assert r["prefill_capacity_ratio"] == 7.5 and r["prefill_kv_bytes_ratio"] == pytest.approx(4 / 30)
    assert r["goals"]["prefill_kv_bytes_ratio"] == pytest.approx(4 / 30)
    assert r["goals"]["prefill_capacity_ratio"] == pytest.approx(0.95 * 30 / 4)
    monkeypatch.setitem(SHARED_CAPACITY, "ratio", 1.0)  # vLLM allocated every layer after all
    r = _run(model)
    assert r["goals_met"]["prefill_capacity_ratio"] is False and r["goals_met"]["prefill_kv_bytes_ratio"] is False
