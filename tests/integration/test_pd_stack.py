"""I3 through real processes on loopback: greedy tokens through proxy -> prefill -> decode equal the
plain full-KV oracle (``kvoffload_testing.oracle``: no shared buffers, host pool or hot cache),
for short and long prompts, completions and chat, streaming and not; and afterwards no slot, pool
byte or lease is left held (Stats). The prefill logs the guide's buffer-plan line, exactly."""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.request

import pytest

from dsamodel.tokenizer import ByteTokenizer
from kvoffload_testing.oracle import greedy_reference
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import post_json, stack_stats, stream_token_ids

pytestmark = pytest.mark.stack

BS = 16


def _config(model_dir, tmp, prefills: int, decodes: int, **kw) -> StackConfig:
    return StackConfig(
        model=model_dir,
        log_dir=tmp / "logs",
        **free_stack_ports(prefills, decodes),
        max_model_len=8192,
        block_size=BS,
        **kw,
    )


# this module's stack decodes with miss prefetch and MTP speculative decoding on (I3 below holds
# with them: greedy tokens equal the plain full-KV oracle's; off is the default, which every
# other stack test runs)
DECODE_ARGS = {
    "decode-0": [
        "--additional-config",
        json.dumps(
            {
                "sparse_kv_offload_config": {
                    "enabled": True,
                    "topk_buffer_size": 128,
                    "dram_size_per_dp_GB": 1,
                    "miss_prefetch": True,
                }
            }
        ),
        "--speculative-config",
        json.dumps({"method": "deepseek_mtp", "num_speculative_tokens": 1}),
    ]
}


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    cfg = _config(model_dir, tmp_path_factory.mktemp("stack"), 1, 1, service_args=DECODE_ARGS)
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def reference(model_dir):
    """The oracle's greedy tokens (the model's plain full-KV path, kvoffload_testing.oracle)."""
    return greedy_reference(model_dir, block_size=BS, max_model_len=8192)


TOK = ByteTokenizer()
LONG_TEXT = "".join(chr(32 + (i * 7919) % 90) for i in range(4200))


@pytest.mark.parametrize("prompt", [[65], list(range(66, 66 + BS - 1)), "long"], ids=["1", "bs-1", "4200"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_i3_completions(stack, reference, prompt, stream):
    ids = TOK.encode(LONG_TEXT, add_bos=True) if prompt == "long" else prompt
    body = {"prompt": ids, "max_tokens": 12, "temperature": 0}
    url = f"{stack.url}/v1/completions"
    got = stream_token_ids(url, body) if stream else post_json(url, body)["choices"][0]["token_ids"]
    assert got == reference(ids, 12)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_i3_chat(stack, reference, stream):
    messages = [{"role": "user", "content": "Explain sparse attention. " * 20}]
    ids = TOK.encode(TOK.apply_chat_template(messages), add_bos=False)
    body = {"messages": messages, "max_tokens": 10, "temperature": 0}
    url = f"{stack.url}/v1/chat/completions"
    got = stream_token_ids(url, body) if stream else post_json(url, body)["choices"][0]["token_ids"]
    assert got == reference(ids, 10)


def test_the_decode_drafts_with_the_mtp_layer(stack):
    """Greedy requests start with the prefill's MTP draft and redraft every step (the tokens are
    checked against the plain engine by the I3 tests above)."""
    before = stack_stats(stack.cfg)["decode-0"]
    post_json(f"{stack.url}/v1/completions", {"prompt": "draft " * 40, "max_tokens": 16, "temperature": 0})
    after = stack_stats(stack.cfg)["decode-0"]
    assert after["drafts"] - before["drafts"] >= 15  # one draft verified per step after the first token
    assert after["drafts_accepted"] <= after["drafts"]


def test_nothing_is_left_held(stack):
    post_json(f"{stack.url}/v1/completions", {"prompt": "one more", "max_tokens": 3, "temperature": 0})
    stats = stack_stats(stack.cfg)
    assert stats["prefill-0"]["held_slots"] == 0
    assert stats["decode-0"]["pool_used_bytes"] == 0 and stats["decode-0"]["sequences"] == 0
    assert stats["decode-0"]["pool_live_leases"] == 0 and stats["prefill-0"]["pool_live_leases"] == 0


def test_the_prefill_logs_the_guides_buffer_plan_line(stack, model_dir):
    """The guide's start-up line, exactly, with the numbers of this prefill's plan (its model's layers,
    3 shared buffers, layer 0 independent: the stack's store config)."""
    from dsamodel.config import ModelConfig
    from kvcore.plan import BufferPlan
    from kvoffload_engine.model_layout import kv_layout

    layout = kv_layout(ModelConfig.from_json(model_dir / "config.json"), BS)
    line = BufferPlan.build(layout, 3, [0]).log_line()
    assert line.startswith("Layerwise KV cache reuse merged ") and line.endswith(" buffer assignments."), line
    assert line in (stack.cfg.log_dir / "prefill-0.log").read_text()


def test_the_prefill_takes_its_metastore_from_the_guides_mmc_local_conf(stack):
    """The stack's prefill gets no --metastore: its pool is indexed by the metastore its mmc-local.conf
    names (ock.mmc.meta_service_url), and its start-up line says where the index came from."""
    c = stack.cfg
    lines = [json.loads(x) for x in (c.log_dir / "prefill-0.log").read_text().splitlines() if '"host pool size"' in x]
    assert len(lines) == 1, lines
    conf = c.log_dir / "mmc-local.conf"
    assert lines[0]["index"] == f"{c.host}:{c.metastore_port}", lines[0]
    assert lines[0]["index_source"] == f"ock.mmc.meta_service_url = tcp://{c.host}:{c.metastore_port} ({conf}:2)"


def test_every_http_service_exports_its_metrics(stack):
    # sampled, so it never drafts: its steps run the miss prefetch (a step with drafts does not)
    post_json(f"{stack.url}/v1/completions", {"prompt": "x" * 300, "max_tokens": 4, "temperature": 0.5, "seed": 1})
    c = stack.cfg

    def metrics(port):
        with urllib.request.urlopen(f"http://{c.host}:{port}/metrics", timeout=10) as r:
            return r.read().decode()

    decode, prefill = metrics(c.decode_ports[0]), metrics(c.prefill_ports[0])
    for name in (
        'kvoffload_decode_hot_cache_hit_rate_by_layer{layer="0"}',
        "kvoffload_decode_h2d_bytes_per_step",
        "kvoffload_decode_read_done_ms_avg",
        "kvoffload_decode_pool_used_bytes",
        'kvoffload_decode_requests_total{outcome="ok"}',
        "kvoffload_decode_prefetch_hits_per_step",
    ):
        assert name in decode, name
    prefetched = [line for line in decode.splitlines() if line.startswith("kvoffload_decode_prefetched_rows_per_step ")]
    assert len(prefetched) == 1 and float(prefetched[0].split()[1]) > 0, prefetched  # the prefetch really ran
    for name in (
        "kvoffload_prefill_gate_wait_seconds_total",
        "kvoffload_prefill_read_done_ms_avg",
        "kvoffload_prefill_pool_used_bytes",
        'kvoffload_prefill_requests_total{outcome="ok"}',
    ):
        assert name in prefill, name
    assert "kvoffload_proxy" in metrics(c.proxy_port)


def test_one_request_id_follows_a_request_through_every_service(stack):
    """The client's X-Request-Id is the request_id of the request's log lines in proxy, decode and
    prefill (the wire id between prefill and decode rides along as child_id); Stats' ledger
    records the request's stages under the wire id."""
    import time
    import uuid

    trace = f"trace-{uuid.uuid4().hex}"
    out = post_json(
        f"{stack.url}/v1/completions",
        {"prompt": "follow me " * 30, "max_tokens": 3, "temperature": 0},
        headers={"X-Request-Id": trace},
    )
    time.sleep(0.5)  # the last lines reach the log files
    by_service = {}
    for name in ("proxy", "decode-0", "prefill-0"):
        lines = [
            json.loads(x) for x in (stack.cfg.log_dir / f"{name}.log").read_text().splitlines() if x.startswith("{")
        ]
        by_service[name] = [e for e in lines if e.get("request_id") == trace]
        wire = {e.get("child_id") for e in by_service[name]} - {None}
        stray = [e for e in lines if e.get("request_id") in wire]  # a line under the wire id alone
        assert not stray, (name, stray[:3])
    assert all(by_service.values()), {k: len(v) for k, v in by_service.items()}
    assert {e["event"] for e in by_service["decode-0"]} >= {"request_admitted"}
    assert {e["event"] for e in by_service["prefill-0"]} >= {"prefill_finished"}
    from kvoffload_proto.v1 import stats_pb2, stats_pb2_grpc
    from svcruntime.tls import secure_or_insecure_channel

    with secure_or_insecure_channel(f"{stack.cfg.host}:{stack.cfg.kv_port}", None) as ch:
        reply = stats_pb2_grpc.StatsStub(ch).GetStats(stats_pb2.StatsRequest(include_ledger=True), timeout=5)
    ledger = json.loads(reply.ledger_json)
    mine = [e for e in ledger["finished"] if e["request_id"] == out["id"]]
    assert mine and mine[0]["outcome"] == "ok", ledger
    assert [s for s, _ in mine[0]["history"]] == ["admitted", "awaiting_prefill", "pulling", "ready", "decoding", "ok"]


@pytest.mark.slow
def test_two_prefills_two_decodes_sixteen_concurrent_streams(model_dir, tmp_path, reference):
    cfg = _config(model_dir, tmp_path, 2, 2)
    prompts = [TOK.encode(f"request {i}: " + "kv offload " * (5 + 7 * i), add_bos=True) for i in range(16)]
    with Stack(cfg) as s:
        with cf.ThreadPoolExecutor(16) as pool:
            outs = list(
                pool.map(
                    lambda p: stream_token_ids(
                        f"{s.url}/v1/completions", {"prompt": p, "max_tokens": 8, "temperature": 0}
                    ),
                    prompts,
                )
            )
        stats = stack_stats(cfg)
    for p, out in zip(prompts, outs):
        assert out == reference(p, 8)
    pulls = [stats[f"decode-{i}"]["read_done"] for i in range(2)]
    assert all(n > 0 for n in pulls), pulls  # the load was spread over both decoders
    for name, st in stats.items():
        if name == "metastore":
            continue
        if name.startswith("decode"):
            assert st["pool_used_bytes"] == 0 and st["sequences"] == 0
        else:
            assert st["held_slots"] == 0 and st["pool_live_leases"] == 0


@pytest.mark.slow
def test_i3_on_two_decode_dp_ranks(model_dir, tmp_path, reference):
    """Two decode processes as the DP ranks 0 and 1 of one deployment (one kv_port, --dp-rank):
    each serves on kv_port + rank, registers under its true DP rank, and the proxy spreads the
    requests over both; tokens equal the oracle's."""
    cfg = _config(model_dir, tmp_path, 1, 2, decode_dp=True)
    prompts = [TOK.encode(LONG_TEXT[: 300 + 40 * i], add_bos=True) for i in range(8)]
    with Stack(cfg) as s, cf.ThreadPoolExecutor(8) as pool:
        outs = list(
            pool.map(
                lambda p: post_json(f"{s.url}/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0}),
                prompts,
            )
        )
        stats = stack_stats(cfg)
    for p, out in zip(prompts, outs):
        assert out["choices"][0]["token_ids"] == reference(p, 6)
    assert all(stats[f"decode-{i}"]["read_done"] > 0 for i in range(2)), stats  # both ranks served
    registered = [
        json.loads(line)
        for line in (cfg.log_dir / "proxy.log").read_text().splitlines()
        if '"decoder_registered"' in line
    ]
    by_port = {r["remote"]: r["remote_dp_rank"] for r in registered}
    assert by_port == {f"{cfg.host}:{cfg.kv_port}": 0, f"{cfg.host}:{cfg.kv_port + 1}": 1}, by_port


@pytest.mark.slow
def test_i3_across_hosts_streams_layers_over_grpc(model_dir, tmp_path, reference):
    """A prefill on "another host": the decode cannot attach its shared memory and pulls every layer
    from the prefill's LayerSource in bounded chunks; tokens are unchanged."""
    cfg = _config(model_dir, tmp_path, 1, 1)
    cfg.service_env = {"prefill-0": {"KVOFFLOAD_HOST_ID": "prefill-host"}}
    ids = TOK.encode(LONG_TEXT[:2500], add_bos=True)
    with Stack(cfg) as s:
        got = post_json(f"{s.url}/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0})
        stats = stack_stats(cfg)
    assert got["choices"][0]["token_ids"] == reference(ids, 8)
    d = stats["decode-0"]
    assert d["read_done"] == 2 * 5  # two chunks (2048 + 453 tokens) x five layers
    assert d["reads_streamed"] == 2 * 5 * 2 and d["reads_shared_memory"] == 0  # main + indexer, all streamed
    assert d["bytes_read"] == 2501 * 5 * (208 + 32) * 2  # every row of every layer, bf16
    assert stats["prefill-0"]["held_slots"] == 0


def test_the_openai_client_lists_the_decoders_model_through_the_proxy(stack):
    """What many clients call first: the official client's ``models.list()`` through the real proxy
    reaches the real decode's ``GET /v1/models`` and returns its served model name."""
    import openai

    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=30)
    ids = [m.id for m in client.models.list()]
    assert ids == [stack.cfg.model.name]
    decode = f"http://{stack.cfg.host}:{stack.cfg.decode_ports[0]}"
    with urllib.request.urlopen(f"{decode}/v1/models", timeout=30) as resp:
        assert [m["id"] for m in json.load(resp)["data"]] == ids
