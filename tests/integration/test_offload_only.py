"""Offload-only mode, the seed's first deployment (``kvoffload up --mode offload-only``): a prefill
whose kv-transfer-config is an AscendStoreConnector alone serves complete requests itself — no
decode, no proxy — with layerwise offload over 3 shared buffers and the host pool's prefix cache
(the embedded pool, indexed by the metastore). Its greedy tokens equal the single-process engine's;
I1: with every layer independent (no buffer reuse) tokens and log-probabilities are the same; a
shared prefix is loaded from the pool; what it cannot honour is a 400; a client that goes away
cancels its request."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
import uuid

import pytest

from dsamodel.tokenizer import ByteTokenizer
from kvoffload_testing.connector_configs import offload_only_kv_transfer_config
from kvoffload_testing.oracle import greedy_reference
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import post_json, stack_stats, stream_token_ids

pytestmark = pytest.mark.stack

BS = 16
TOK = ByteTokenizer()
LONG_TEXT = "".join(chr(32 + (i * 7919) % 90) for i in range(2600))


def _stack(model_dir, log_dir, **kw) -> Stack:
    return Stack(
        StackConfig(
            model=model_dir,
            log_dir=log_dir,
            **free_stack_ports(1, 0),
            max_model_len=8192,
            block_size=BS,
            mode="offload-only",
            **kw,
        )
    )


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with _stack(model_dir, tmp_path_factory.mktemp("offload-only") / "logs") as s:
        yield s


@pytest.fixture(scope="module")
def reference(model_dir):
    return greedy_reference(model_dir, block_size=BS, max_model_len=8192)


def _finished(stack: Stack, request_id: str) -> dict:
    time.sleep(0.3)  # the line reaches the log file
    for line in (stack.cfg.log_dir / "prefill-0.log").read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "request_finished" and event.get("request_id") == request_id:
                return event
    raise AssertionError(f"no request_finished line for {request_id}")


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _status(url: str, body: dict) -> tuple[int, str]:
    try:
        post_json(url, body)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]["message"]
    return 200, ""


def test_the_stack_is_a_metastore_and_one_prefill_with_the_store_connector_alone(stack):
    assert [s.name for s in stack.services] == ["metastore", "prefill-0"]
    argv = dict((n, a) for n, a, _ in stack.commands())["prefill-0"]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "AscendStoreConnector" and kv["kv_role"] == "kv_producer"
    assert stack.url == f"http://{stack.cfg.host}:{stack.cfg.prefill_ports[0]}"
    serving = [
        json.loads(x)
        for x in (stack.cfg.log_dir / "prefill-0.log").read_text().splitlines()
        if x.startswith("{") and '"event": "serving"' in x
    ]
    assert serving and serving[0]["mode"] == "offload-only" and serving[0]["backend"] == "kvoffload"
    health = _get_json(f"{stack.url}/health")
    assert health["status"] == "ok" and health["mode"] == "offload-only"
    models = _get_json(f"{stack.url}/v1/models")
    assert [m["id"] for m in models["data"]] == [stack.cfg.model.resolve().name]


@pytest.mark.parametrize("prompt", [[65], list(range(66, 66 + BS - 1)), "long"], ids=["1", "bs-1", "2600"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_greedy_tokens_equal_the_single_process_engine(stack, reference, prompt, stream):
    ids = TOK.encode(LONG_TEXT, add_bos=True) if prompt == "long" else prompt
    body = {"prompt": ids, "max_tokens": 10, "temperature": 0}
    url = f"{stack.url}/v1/completions"
    got = stream_token_ids(url, body) if stream else post_json(url, body)["choices"][0]["token_ids"]
    assert got == reference(ids, 10)


def test_chat_and_usage(stack):
    out = post_json(
        f"{stack.url}/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0},
    )
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["completion_tokens"] == len(out["choices"][0]["token_ids"]) == 4


def test_a_shared_prefix_is_loaded_from_the_pool_and_reset_drops_it(stack, reference):
    prefix = "".join(chr(40 + (i * 31) % 80) for i in range(1500))
    url = f"{stack.url}/v1/completions"
    cached = []
    for n in range(2):
        ids = TOK.encode(prefix + f" question {n}", add_bos=True)
        rid = f"offload-prefix-{uuid.uuid4().hex}"
        out = post_json(url, {"prompt": ids, "max_tokens": 5, "temperature": 0}, headers={"X-Request-Id": rid})
        assert out["choices"][0]["token_ids"] == reference(ids, 5)
        cached.append(_finished(stack, rid)["cached_tokens"])
    assert cached[0] == 0 and cached[1] >= (1 + 1500) // BS * BS, cached
    metrics = urllib.request.urlopen(f"{stack.url}/metrics", timeout=5).read().decode()
    line = next(x for x in metrics.splitlines() if x.startswith("kvoffload_prefill_cached_tokens_total "))
    assert float(line.split()[1]) >= cached[1]
    reset = post_json(f"{stack.url}/reset_prefix_cache", {})
    assert reset["removed"] > 0 and reset["kept_leased"] == 0
    ids = TOK.encode(prefix + " question 2", add_bos=True)
    rid = f"offload-prefix-{uuid.uuid4().hex}"
    post_json(url, {"prompt": ids, "max_tokens": 2, "temperature": 0}, headers={"X-Request-Id": rid})
    assert _finished(stack, rid)["cached_tokens"] == 0


def test_what_it_cannot_honour_is_a_400_naming_it(stack):
    url = f"{stack.url}/v1/completions"
    for body, words in [
        (
            {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}},
            "kv_transfer_params: this prefill runs offload-only",
        ),
        ({"prompt": "x", "n": 2}, "n: offload-only mode returns one choice per request"),
        ({"prompt": "x", "tools": []}, "tools: not supported"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate: unknown parameter"),
        ({"prompt": "x" * 9000}, "exceeds max_model_len=8192"),
    ]:
        status, message = _status(url, body)
        assert status == 400 and words in message, (body, status, message)


def test_stop_strings_are_honoured(stack):
    url = f"{stack.url}/v1/completions"
    full = post_json(url, {"prompt": "abc", "max_tokens": 12, "temperature": 0})["choices"][0]
    text = full["text"]
    stop = next((text[i : i + 1] for i in range(2, len(text)) if text[i : i + 1].strip()), None)
    assert stop is not None, text
    cut = post_json(url, {"prompt": "abc", "max_tokens": 12, "temperature": 0, "stop": [stop]})["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]


def test_a_client_that_goes_away_cancels_its_request(stack):
    host, port = stack.cfg.host, stack.cfg.prefill_ports[0]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    rid = f"offload-gone-{uuid.uuid4().hex}"
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": "y" * 100, "max_tokens": 4000, "temperature": 0, "stream": True, "ignore_eos": True}),
        {"Content-Type": "application/json", "X-Request-Id": rid},
    )
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()
    deadline = time.monotonic() + 30
    while stack_stats(stack.cfg)["prefill-0"]["requests"] != 0:
        assert time.monotonic() < deadline, "the request still runs after its client went away"
        time.sleep(0.2)
    assert '"event": "request_cancelled"' in (stack.cfg.log_dir / "prefill-0.log").read_text()


def test_i1_buffer_reuse_changes_nothing_the_client_sees(stack, model_dir, tmp_path):
    """The same long prompt with 3 shared buffers (the stack) and with every layer independent
    (no reuse): identical tokens and top-2 log-probabilities."""
    body = {"prompt": TOK.encode(LONG_TEXT[:1800], add_bos=True), "max_tokens": 6, "temperature": 0, "logprobs": 2}
    shared = post_json(f"{stack.url}/v1/completions", body)["choices"][0]
    all_independent = offload_only_kv_transfer_config(independent="all")
    with _stack(
        model_dir, tmp_path / "logs", service_args={"prefill-0": ["--kv-transfer-config", all_independent]}
    ) as other:
        plain = post_json(f"{other.url}/v1/completions", body)["choices"][0]
        plan = [
            json.loads(x)
            for x in (other.cfg.log_dir / "prefill-0.log").read_text().splitlines()
            if x.startswith("{") and '"event": "serving"' in x
        ][0]["plan"]
    assert (
        plan
        != [
            json.loads(x)
            for x in (stack.cfg.log_dir / "prefill-0.log").read_text().splitlines()
            if x.startswith("{") and '"event": "serving"' in x
        ][0]["plan"]
    )
    assert shared["token_ids"] == plain["token_ids"] and shared["logprobs"] == plain["logprobs"]


def test_up_takes_mode_offload_only_for_the_reference_engine_only(tmp_path, capsys, monkeypatch):
    from kvoffload.cli import build_parser, main
    from kvoffload.cli_stack import stack_config

    monkeypatch.delenv("KVOFFLOAD_API_KEY", raising=False)
    args = build_parser().parse_args(
        ["up", "--mode", "offload-only", "--port", "9100", "--model", str(tmp_path), "--log-dir", str(tmp_path)]
    )
    cfg = stack_config(args)
    assert (cfg.mode, cfg.prefill_ports) == ("offload-only", (9100,))
    assert [n for n, _, _ in Stack(cfg).commands()] == ["metastore", "prefill-0"]
    assert build_parser().parse_args(["up"]).mode == "pd"
    for argv, words in [
        (["up", "--engine", "vllm", "--mode", "offload-only"], "--mode offload-only: only with --engine reference"),
        (
            ["up", "--mode", "offload-only", "--api-key", "k", "--model", str(tmp_path)],
            "--mode offload-only runs no proxy",
        ),
    ]:
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        assert words in capsys.readouterr().err
