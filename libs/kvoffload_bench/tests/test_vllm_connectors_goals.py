"""``kvoffload bench vllm`` meets its goals only when the decode pulled the prompts' KV: a P/D run whose
every pull failed (the decode recomputed the prompt, and its tokens are still right) meets neither
``pd_requests_pulled`` nor ``pd_requests_failed``, nor a backend's ``pull_by_backend.<b>.requests_*``.

``run`` is driven end to end with the servers replaced (no vLLM starts): each stream answers at
once, and the counters the bench reads from the servers' ``/metrics`` are kept here (each P/D
decode's its own, its reads counted as its backend's), moved by the streams as the real servers
would move them. The model has 30 layers; the P/D prefill is configured (by the bench, through
``kvoffload_testing.vllm_stack``) with 3 shared buffers and layer 0 independent, logs a plan of 4
buffers for 30 layers (a test may change the line) and holds ``SHARED_CAPACITY`` times the plain
server's tokens. ``EVENTS`` records each start, stop and timed round, by server."""

from __future__ import annotations

import collections
import itertools
import json

import pytest

from kvoffload_bench import vllm_backends, vllm_pd, vllm_shared, vllm_stream
from kvoffload_bench import vllm_connectors as bench_vllm
from kvoffload_testing.vllm_stack import vllm_prefill_transfer_config

HITS = "vllm:external_prefix_cache_hits_total"
PLAIN_CAPACITY = 23_296
SHARED_CAPACITY = {"ratio": 7.5}  # the prefill's capacity over the plain server's (a test may change it)
PREFILL_LOG = {"line": "kvoffload_shared_buffers block_bytes_per_buffer=1 buffers=4 layers=30 num_blocks=1"}
EVENTS: list[tuple[str, str]] = []  # (what, whose): ("start" | "stop" | "round 0" ..., a log file's stem)
LAYERS = 30
ROUNDS = 2
PD_PROMPT_TOKENS = 200


class _Service:
    """A vLLM server, metastore or proxy: its address only."""

    prefill_urls: set[str] = set()
    by_url: dict[str, _Service] = {}
    ports = itertools.count(1)  # below any real port: never one of free_stack_ports'

    def __init__(self, *args, port: int | None = None, log_path=None, **kw) -> None:
        self.port = port or (args[0] if args and isinstance(args[0], int) else next(self.ports))
        self.url, self.address = f"http://127.0.0.1:{self.port}", f"127.0.0.1:{self.port}"
        self.log_name = log_path.name if log_path is not None else ""
        self.prefill = self.log_name.endswith("prefill.log")  # each P/D pair's: "<backend>-prefill.log"
        if self.prefill:
            self.prefill_urls.add(self.url)
        self.by_url[self.url] = self

    def log_text(self) -> str:
        return PREFILL_LOG["line"] if self.prefill else ""

    def start(self) -> _Service:
        EVENTS.append(("start", self.log_name.removesuffix(".log")))
        return self

    def stop(self) -> None:
        EVENTS.append(("stop", self.log_name.removesuffix(".log")))

    def __enter__(self) -> _Service:
        return self

    def __exit__(self, *exc) -> None:
        return None


class _Proxy(_Service):
    decode_of: dict[str, str] = {}  # proxy URL -> its decode's URL

    def __init__(self, port: int, prefill_port: int, decode_port: int, log_path) -> None:
        super().__init__(port=port, log_path=log_path)
        self.decode_of[self.url] = f"http://127.0.0.1:{decode_port}"


@pytest.fixture
def servers(tmp_path, monkeypatch):
    """Replaces the servers; returns the test's knobs and the model directory. Knobs: ``failed``, the
    backends whose decode fails every pull (and recomputes); ``one_event``, the servers ("plain" or a
    backend) that deliver a whole answer in one event (their TPOT is then the server's own latency);
    ``matrix``: "differs" makes one matrix answer through P/D differ; ``slow``: a server's log name ->
    how many times slower its TTFT is."""
    import kvoffload_testing.vllm_server

    metrics: collections.Counter = collections.Counter()  # the store server's and the plain server's
    decodes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # each decode's own
    seen: set[tuple[int, ...]] = set()
    knobs: dict = {"failed": set(), "one_event": set(), "slow": {}}
    consumer = vllm_backends.CONSUMER.format
    rounds = {tuple(vllm_stream.pd_prompt(r, PD_PROMPT_TOKENS)): r for r in range(ROUNDS)}
    EVENTS.clear()

    def stream(url: str, model: str, prompt: list[int], max_tokens: int):
        who = _Service.by_url[url].log_name.split("-")[0].removesuffix(".log")  # plain, vllm or a backend
        if url in _Proxy.decode_of:  # the decode pulls the prompt's KV (or fails to), through its backend
            decode = _Proxy.decode_of[url]
            pulled = who not in knobs["failed"]
            counts = decodes[decode]
            counts[consumer("requests_pulled" if pulled else "requests_failed")] += 1
            counts[consumer("bytes_read")] += 1000 * pulled
            counts[consumer("read_ms_total")] += 1e-6 * pulled  # 1 ns: far faster than any memcpy
            counts[consumer("reads_engine" if who == "mooncake" else "reads_streamed")] += 30 * pulled
        if tuple(prompt) in rounds:
            EVENTS.append((f"round {rounds[tuple(prompt)]}", who))
        hit = tuple(prompt) in seen  # the store part's second send of a prompt loads it from the pool
        seen.add(tuple(prompt))
        metrics[HITS] += hit * (len(prompt) // vllm_pd.BLOCK_SIZE) * vllm_pd.BLOCK_SIZE
        ttft = (0.1 if hit else 1.0) * knobs["slow"].get(_Service.by_url[url].log_name, 1.0)
        if who in knobs["one_event"]:  # every token in one event; the server timed 3 steps of 20 ms
            metrics[vllm_stream.ITL[0]] += 0.06
            metrics[vllm_stream.ITL[1]] += 3
            return ttft, ["a", "b", "c", "d"], [ttft] * 4
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

    monkeypatch.setattr(bench_vllm.pd_matrix, "answers", _matrix(knobs))
    monkeypatch.setattr(
        vllm_shared,
        "capacity_tokens",
        lambda url: int(PLAIN_CAPACITY * (SHARED_CAPACITY["ratio"] if url in _Service.prefill_urls else 1)),
    )
    return knobs, _config_only_model(tmp_path / "model")


def _matrix(knobs: dict):
    """The equality matrix's answers: the proxy's differ in one case where the test asks."""

    def answers(url: str, model: str, lengths: tuple[int, ...]) -> dict:
        out = {f"completion-{n}": (["a", "b"], [-0.5, -0.25]) for n in lengths}
        if url in _Proxy.decode_of and knobs.get("matrix") == "differs":
            out[f"completion-{lengths[-1]}"] = (["a", "c"], [-0.5, -0.25])
        return out

    return answers


def _config_only_model(model):
    """A model directory holding only the config.json the bench reads (its layers: ``LAYERS``)."""
    model.mkdir()
    config = {"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": LAYERS, "num_key_value_heads": 2}
    (model / "config.json").write_text(json.dumps(config))
    return model


def _run(model, **kw) -> dict:
    return bench_vllm.run(
        model=str(model),
        prefix_tokens=256,
        rounds=ROUNDS,
        max_tokens=4,
        pd_prompt_tokens=PD_PROMPT_TOKENS,
        pd_max_tokens=4,
        progress=False,
        **kw,
    )


def test_goals_are_not_met_when_every_pull_failed_and_the_decode_recomputed(servers):
    knobs, model = servers
    knobs["failed"] |= {"grpc_stream", "mooncake"}
    r = _run(model)
    assert r["tokens_equal"] is True and r["goals_met"]["tokens_equal"] is True  # recomputing gives the tokens
    assert (r["pd_requests_pulled"], r["pd_requests_failed"]) == (0, 2)
    assert r["goals_met"]["pd_requests_pulled"] is False and r["goals_met"]["pd_requests_failed"] is False
    assert r["pd_bytes_pulled_per_request"] is None  # nothing pulled: no bytes per pulled request
    mooncake = r["pull_by_backend"]["mooncake"]  # no read went through the engine: no rate, goal not met
    assert not mooncake["path_checked"] and mooncake["ratio_to_memcpy"] is None
    assert r["goals_met"]["pull_by_backend.mooncake.ratio_to_memcpy"] is False
    assert "pull_by_backend.mooncake.ratio_to_memcpy" in r["not_measured"]
    for backend in ("grpc_stream", "mooncake"):  # each pair's decode recomputed both rounds
        by = r["pull_by_backend"][backend]
        assert (by["requests_pulled"], by["requests_failed"]) == (0, 2), by
        assert r["goals_met"][f"pull_by_backend.{backend}.requests_pulled"] is False
        assert r["goals_met"][f"pull_by_backend.{backend}.requests_failed"] is False


def test_a_failing_mooncake_pull_fails_the_mooncake_goals_though_its_tokens_are_equal(servers):
    """The gRPC stream's pair (the pd_* figures) pulled every prompt; the Mooncake pair's decode failed
    both pulls and recomputed: equal tokens, but its own pull goals are not met."""
    knobs, model = servers
    knobs["failed"].add("mooncake")
    r = _run(model)
    assert r["tokens_equal_by_backend"] is True and r["goals_met"]["tokens_equal_by_backend"] is True
    assert r["goals_met"]["pd_requests_pulled"] is True and r["goals_met"]["pd_requests_failed"] is True
    by = r["pull_by_backend"]
    assert {b: (by[b]["requests_pulled"], by[b]["requests_failed"]) for b in by} == {
        "grpc_stream": (2, 0),
        "mooncake": (0, 2),
    }
    key = "pull_by_backend.{}.requests_{}".format
    assert (r["goals"][key("mooncake", "pulled")], r["goals"][key("mooncake", "failed")]) == (ROUNDS, 0)
    assert r["goals_met"][key("mooncake", "failed")] is False and r["goals_met"][key("mooncake", "pulled")] is False
    assert r["goals_met"][key("grpc_stream", "failed")] is True and r["goals_met"][key("grpc_stream", "pulled")]


def test_the_plain_rounds_take_turns_with_the_p_d_rounds_every_server_up(servers):
    """Round r on the plain server, then through the gRPC pair, then the Mooncake pair; the plain server
    is up from before the pairs start until after they stop, and the store server stopped first."""
    _, model = servers
    r = _run(model)
    rounds = [e for e in EVENTS if e[0].startswith("round ")]
    assert rounds == [(f"round {i}", who) for i in range(ROUNDS) for who in ("plain", "grpc_stream", "mooncake")]
    up, down = EVENTS.index(("start", "plain")), EVENTS.index(("stop", "plain"))
    for server in ("grpc_stream-prefill", "grpc_stream-decode", "mooncake-prefill", "mooncake-decode"):
        assert up < EVENTS.index(("start", server)) < EVENTS.index(("stop", server)) < down, (server, EVENTS)
    assert EVENTS.index(("stop", "vllm")) < EVENTS.index(("start", "grpc_stream-prefill")), EVENTS
    assert r["pd_cores"]["plain"] == r["pd_cores"]["decode"]  # the plain server on the decodes' half


@pytest.mark.parametrize(
    ("one_event", "unmeasured"),
    [
        ({"plain"}, {"pd_tpot_ratio", "grpc_stream", "mooncake"}),  # the plain server's own latency
        ({"mooncake"}, {"mooncake"}),  # the Mooncake pair's proxy gave every token in one event
        ({"plain", "grpc_stream", "mooncake"}, set()),  # every side the servers' own: comparable
    ],
)
def test_a_tpot_ratio_of_a_client_stream_against_a_servers_own_latency_is_not_measured(servers, one_event, unmeasured):
    knobs, model = servers
    knobs["one_event"] |= one_event
    r = _run(model)
    sources = {p["plain_tpot_source"] for p in r["pd_per_round"]}
    assert sources == {"server" if "plain" in one_event else "stream"}
    ratios = {"pd_tpot_ratio": r["pd_tpot_ratio"]} | {b: p["pd_tpot_ratio"] for b, p in r["pull_by_backend"].items()}
    assert {k for k, v in ratios.items() if v is None} == unmeasured, ratios
    for key in {"pd_tpot_ratio", "pull_by_backend.mooncake.pd_tpot_ratio"}:
        judged = key.split(".")[1] if "." in key else key
        assert r["goals_met"][key] is (judged not in unmeasured)
        assert (key in r["not_measured"]) is (judged in unmeasured)
        if judged in unmeasured:
            assert "different sources" in r["not_measured"][key], r["not_measured"]
    if not unmeasured:  # the servers timed 20 ms a token on both sides
        assert r["pd_tpot_ratio"] == pytest.approx(1.0) and r["pd_tpot_ratio_not_measured"] is None


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
    for key in ("ratio_to_memcpy", "pd_tpot_ratio", "requests_pulled", "requests_failed"):
        assert r["goals_met"][f"pull_by_backend.mooncake.{key}"] is False
        assert "not run" in r["not_measured"][f"pull_by_backend.mooncake.{key}"]
    assert r["goals_met"]["pull_by_backend.grpc_stream.requests_pulled"] is True
    assert r["goals_met"]["pull_by_backend.grpc_stream.requests_failed"] is True
    with pytest.raises(ValueError, match="backends: expected grpc_stream"):
        _run(model, backends=("mooncake",))


def test_goals_are_not_met_when_one_matrix_answer_differs_through_p_d(servers):
    knobs, model = servers
    knobs["matrix"] = "differs"
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


def test_the_shared_buffer_goals_come_from_the_config_not_from_the_prefills_own_log(servers, monkeypatch):
    """A prefill that kept every layer and logged as much (buffers = layers) meets no shared-buffer
    goal: the bench configured 3 shared buffers and layer 0 apart, 4 buffers for the model's 30 layers."""
    _, model = servers
    monkeypatch.setitem(PREFILL_LOG, "line", "kvoffload_shared_buffers buffers=30 layers=30 num_blocks=1")
    monkeypatch.setitem(SHARED_CAPACITY, "ratio", 1.0)
    r = _run(model)
    assert (r["prefill_buffers"], r["prefill_layers"]) == (4, LAYERS)
    assert (r["prefill_buffers_logged"], r["prefill_layers_logged"]) == (30, 30)
    assert r["goals"]["prefill_capacity_ratio"] == pytest.approx(0.95 * 30 / 4)
    assert r["goals"]["prefill_kv_bytes_ratio"] == pytest.approx(4 / 30)
    for goal in ("prefill_capacity_ratio", "prefill_kv_bytes_ratio", "prefill_buffers_logged"):
        assert r["goals_met"][goal] is False, goal


def test_a_logged_buffer_count_that_disagrees_with_the_config_fails_its_goal(servers, monkeypatch):
    _, model = servers
    monkeypatch.setitem(PREFILL_LOG, "line", "kvoffload_shared_buffers buffers=5 layers=30 num_blocks=1")
    r = _run(model)
    assert r["goals"]["prefill_buffers_logged"] == 4 and r["goals_met"]["prefill_buffers_logged"] is False
    assert r["goals_met"]["prefill_capacity_ratio"] is True  # 7.5 times the plain server's: the config's 4 / 30
    monkeypatch.setitem(PREFILL_LOG, "line", "")  # no line at all: not measured
    r = _run(model)
    assert r["prefill_buffers_logged"] is None and r["goals_met"]["prefill_buffers_logged"] is False
    assert "logged no kvoffload_shared_buffers" in r["not_measured"]["prefill_buffers_logged"]


def _store(config: str, **keys) -> str:
    """``config`` (a prefill's MultiConnector) with ``keys`` set in its store's extra config (None: removed)."""
    parsed = json.loads(config)
    extra = parsed["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    for k, v in keys.items():
        if v is None:
            del extra[k]
        else:
            extra[k] = v
    return json.dumps(parsed)


@pytest.mark.parametrize(
    ("keys", "layers", "plan"),
    [
        ({}, 30, (4, 30)),  # the bench's config: 3 shared buffers, layer 0 (the default) apart
        ({}, 6, (4, 6)),
        ({}, 3, (3, 3)),  # 2 layers left for 3 buffers: one each
        ({"layerwise_independent_layers": [0, -1]}, 30, (5, 30)),
        ({"layerwise_independent_layers": [0, 29, -1]}, 30, (5, 30)),  # 29 and -1 are one layer
        ({"layerwise_independent_layers": "all"}, 30, (30, 30)),
        ({"layerwise_num_shared_buffers": None}, 30, (30, 30)),  # no sharing: a buffer per layer
        ({"use_layerwise": False}, 30, (30, 30)),
    ],
)
def test_the_configured_plan_is_computed_from_the_config_sent_and_the_models_layers(tmp_path, keys, layers, plan):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    config = _store(vllm_prefill_transfer_config("127.0.0.1:5000"), **keys)
    assert vllm_shared.configured_plan(config, tmp_path) == plan
    store = json.loads(config)["kv_connector_extra_config"]["connectors"][1]
    assert vllm_shared.configured_plan(json.dumps(store), tmp_path) == plan  # the store connector alone
    with pytest.raises(ValueError, match="no AscendStoreConnector"):
        vllm_shared.configured_plan(json.dumps({"kv_connector": "SfaRemoteD2HConnector"}), tmp_path)


def test_the_chunked_shared_buffer_ratio_is_measured_on_servers_of_its_own_with_512_token_chunks(servers):
    """The same long prompt on a shared-buffer prefill and a plain server, both started with
    ``--max-num-batched-tokens 512`` once the P/D pairs stopped; goal <= 1.10, as the default chunks'."""
    knobs, model = servers
    r = _run(model)
    assert r["prefill_time_ratio_shared_chunk512"] == pytest.approx(1.0)
    assert r["goals"]["prefill_time_ratio_shared_chunk512"] == 1.10 and r["goals"]["prefill_time_ratio_shared"] == 1.10
    assert r["goals_met"]["prefill_time_ratio_shared_chunk512"] is True and r["shared_chunk512_tokens_equal"]
    chunked = ("start", "chunk512-prefill"), ("start", "chunk512-plain")
    assert all(EVENTS.index(("stop", "grpc_stream-prefill")) < EVENTS.index(e) for e in chunked), EVENTS
    knobs["slow"]["chunk512-prefill.log"] = 1.15  # 16 chunks, each reloading the earlier ones: 15 % slower
    r = _run(model)
    assert r["prefill_time_ratio_shared_chunk512"] == pytest.approx(1.15)
    assert r["goals_met"]["prefill_time_ratio_shared_chunk512"] is False
    assert r["goals_met"]["prefill_time_ratio_shared"] is True


def test_a_shared_ratio_past_1_10_fails_its_goal(servers):
    knobs, model = servers
    knobs["slow"]["grpc_stream-prefill.log"] = 11.2  # the fake answers a prompt it saw before 10 times faster
    r = _run(model, shared_chunked=False)
    assert r["prefill_time_ratio_shared"] == pytest.approx(0.112 / 0.1)
    assert r["goals_met"]["prefill_time_ratio_shared"] is False


def test_a_run_without_the_chunked_comparison_does_not_judge_it(servers):
    _, model = servers
    r = _run(model, shared_chunked=False)
    assert not any(name.startswith("chunk512") for _, name in EVENTS), EVENTS  # no server more
    assert r["prefill_time_ratio_shared_chunk512"] is None
    assert r["goals_met"]["prefill_time_ratio_shared_chunk512"] is False
    assert "shared_chunked" in r["not_measured"]["prefill_time_ratio_shared_chunk512"]
