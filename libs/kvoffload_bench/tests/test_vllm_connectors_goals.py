"""``kvoffload bench vllm`` meets its goals only when the decode pulled the prompts' KV: a P/D run whose
every pull failed (the decode recomputed the prompt, and its tokens are still right) meets neither
``pd_requests_pulled`` nor ``pd_requests_failed``, nor a backend's ``pull_by_backend.<b>.requests_*``
(the store part on each pool backend: ``test_vllm_pools_goals.py``).

``run`` is driven end to end on fake servers (``vllm_bench_fakes``: no vLLM starts, counters kept as
the real servers would keep them).
"""

from __future__ import annotations

import json

import pytest
from vllm_bench_fakes import EVENTS, LAYERS, PREFILL_LOG, ROUNDS, SHARED_CAPACITY, fake_servers
from vllm_bench_fakes import run_bench as _run

from kvoffload_bench import vllm_shared
from kvoffload_testing.vllm_stack import vllm_prefill_transfer_config


@pytest.fixture
def servers(tmp_path, monkeypatch):
    """The bench's servers replaced (``vllm_bench_fakes.fake_servers``): the test's knobs and the model."""
    return fake_servers(tmp_path, monkeypatch)


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
