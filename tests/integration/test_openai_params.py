"""Issue 11, the API half: every OpenAI parameter is honoured end to end through proxy -> decode ->
prefill (the first token is the prefill's), or refused with a 400 naming it. Sampled outputs are
compared with the single-process engine run with the same parameters; log-probabilities with the
engine's and, independently of every part of the engine's decode, with ``log_softmax`` over the
whole-sequence reference forward's logits (``dense_logprobs``)."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import openai
import pytest
from openai_params_client import (
    DENSE_LOGPROB_TOL,
    choice_text,
    dense_logprobs,
    engine_runner,
    post_status,
    sse_stream,
    streamed_choices,
)

from dsamodel.tokenizer import ByteTokenizer
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import post_json
from openai_api.sampling_params import choice_seed

pytestmark = [pytest.mark.stack, pytest.mark.slow]

BS = 16
TOK = ByteTokenizer()
PROMPT = "The quick brown fox jumps over the lazy dog. 0123456789 " * 3
MESSAGES = [{"role": "user", "content": "Count: 1 2 3 4 5 6 7 8 9"}]


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    cfg = StackConfig(
        model=model_dir,
        log_dir=tmp_path_factory.mktemp("stack") / "logs",
        **free_stack_ports(),
        max_model_len=2048,
        block_size=BS,
    )
    with Stack(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(model_dir):
    return engine_runner(model_dir, BS)


def _prompt_ids(prompt=PROMPT):
    return TOK.encode(prompt, add_bos=True)


def _chat_ids(messages=MESSAGES):
    return TOK.encode(TOK.apply_chat_template(messages), add_bos=False)


@pytest.fixture(scope="module")
def greedy(stack):
    """The greedy continuations (completions and chat) without stop: what stop cuts."""
    comp = post_json(f"{stack.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0})
    chat = post_json(f"{stack.url}/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 40, "temperature": 0})
    return {False: comp["choices"][0], True: chat["choices"][0]}


def _stop_for(text: str) -> str:
    """A printable character of the greedy text past its first few characters (the stop string)."""
    for ch in text[3:]:
        if ch.isprintable() and ch != "\ufffd" and not ch.isspace():
            return ch
    pytest.fail(f"the greedy text has no printable character to stop on: {text!r}")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_string_ends_the_text_before_it(stack, greedy, chat, stream):
    full = choice_text(greedy[chat], chat)
    stop = _stop_for(full)
    expected = full[: full.index(stop)]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {
        "max_tokens": 40,
        "temperature": 0,
        "stop": [stop, "never-generated"],
        **({"messages": MESSAGES} if chat else {"prompt": PROMPT}),
    }
    if stream:
        got = streamed_choices(sse_stream(stack, path, body), chat)[0]
        assert all(stop not in piece for piece in got["pieces"]), got["pieces"]
    else:
        status, data = post_status(stack, path, body)
        assert status == 200, data
        got = data["choices"][0]
        got["text"] = choice_text(got, chat)
    assert got["text"] == expected and got["finish_reason"] == "stop"
    assert stop not in got["text"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_stop_token_id_and_the_openai_client(client, greedy, stream):
    ids = greedy[False]["token_ids"]
    stop_id = ids[4]
    cut = ids.index(stop_id)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"stop_token_ids": [stop_id]})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    else:
        r = client.completions.create(**kw)
        text = r.choices[0].text
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == cut + 1
    assert text == TOK.decode(ids[:cut], skip_special_tokens=True)


def test_min_tokens_bans_stop_ids_in_the_prefill_and_the_decode(stack, greedy, engine):
    ids = greedy[False]["token_ids"]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "min_tokens": 6, "stop_token_ids": [ids[0], ids[2]]}
    data = post_json(f"{stack.url}/v1/completions", body)
    got = data["choices"][0]["token_ids"]
    assert data["usage"]["completion_tokens"] >= 6
    assert got[0] != ids[0]  # the first token, sampled by the prefill, honours min_tokens
    assert not set(got[:6]) & {ids[0], ids[2]}
    ref, _ = engine(_prompt_ids(), body)
    assert got == [t for t in ref if t not in (ids[0], ids[2])][: len(got)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_penalties_and_seeded_sampling_equal_the_engine(stack, engine, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    ids = _chat_ids() if chat else _prompt_ids()
    for params in (
        {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "presence_penalty": -0.5},
    ):
        body = {**prompt, "max_tokens": 16, **params}
        data = post_json(f"{stack.url}{path}", body)
        ref, _ = engine(ids, body, chat=chat)
        assert data["choices"][0]["token_ids"] == ref, params
    plain = post_json(f"{stack.url}{path}", {**prompt, "max_tokens": 16, "temperature": 0})
    penalized = post_json(f"{stack.url}{path}", {**prompt, "max_tokens": 16, "temperature": 0, "presence_penalty": -2})
    assert plain["choices"][0]["token_ids"] != penalized["choices"][0]["token_ids"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_seed_reproduces_the_sample(stack, stream):
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 77}

    def ids(b):
        if stream:
            return streamed_choices(sse_stream(stack, "/v1/completions", b), False)[0]["token_ids"]
        return post_json(f"{stack.url}/v1/completions", b)["choices"][0]["token_ids"]

    first = ids(body)
    assert ids(body) == first
    assert ids({**body, "seed": 78}) != first


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_n_choices(stack, engine, stream):
    body = {"prompt": [PROMPT, "Hello"], "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3}
    if stream:
        events = sse_stream(stack, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        choices = {i: c["token_ids"] for i, c in streamed_choices(events, False).items()}
        usage = events[-1]["usage"]
    else:
        data = post_json(f"{stack.url}/v1/completions", body)
        choices = {c["index"]: c["token_ids"] for c in data["choices"]}
        usage = data["usage"]
    assert sorted(choices) == list(range(6))
    for p, prompt in enumerate(body["prompt"]):
        for j in range(3):
            ref, _ = engine(_prompt_ids(prompt), {**body, "prompt": prompt}, choice=j)
            assert choices[p * 3 + j] == ref, (p, j)
        assert len({tuple(choices[p * 3 + j]) for j in range(3)}) > 1
    assert usage["prompt_tokens"] == len(_prompt_ids()) + len(_prompt_ids("Hello"))  # once per prompt
    assert usage["completion_tokens"] == sum(len(v) for v in choices.values())
    single = post_json(f"{stack.url}/v1/completions", {**body, "prompt": PROMPT, "n": 1})
    assert single["choices"][0]["token_ids"] == choices[0]  # choice 0 keeps the client's seed


def test_n_chat_with_the_openai_client(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, max_tokens=6, temperature=1.0, seed=9)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(_chat_ids())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completion_logprobs_are_the_reference_forwards_log_softmax(stack, engine, model_dir, stream):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3}
    ref_ids, ref_lp = engine(_prompt_ids(), body)
    if stream:
        got = streamed_choices(sse_stream(stack, "/v1/completions", body), False)[0]
        ids, token_lps = got["token_ids"], got["lp"]
    else:
        choice = post_json(f"{stack.url}/v1/completions", body)["choices"][0]
        ids, lp = choice["token_ids"], choice["logprobs"]
        token_lps = lp["token_logprobs"]
        assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(ids)
        for k, (top, e) in enumerate(zip(lp["top_logprobs"], ref_lp, strict=True)):
            assert 3 <= len(top) <= 4
            assert max(top.values()) == pytest.approx(e.top[0][1], abs=1e-4)
            assert lp["tokens"][k] in top
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    assert ids == ref_ids and len(token_lps) == len(ids)
    for got_lp, e in zip(token_lps, ref_lp, strict=True):  # one logprob per token, as many as the engine's
        assert got_lp == pytest.approx(e.logprob, abs=1e-4) and got_lp <= 0
        assert e.logprob == pytest.approx(e.top[0][1])  # greedy picks the most likely token
    _match_the_dense_oracle(model_dir, _prompt_ids(), ids, token_lps)


def _match_the_dense_oracle(model_dir, prompt_ids: list[int], ids: list[int], token_lps: list[float]) -> None:
    """Greedy ``ids`` and their log-probabilities are the whole-sequence reference forward's argmax and
    log_softmax (``dense_logprobs``: no offload, no hot cache, no sampler), within bf16's rounding."""
    dense = dense_logprobs(model_dir, prompt_ids, ids)
    assert dense.argmax(-1).tolist() == ids
    expected = [dense[i, t].item() for i, t in enumerate(ids)]
    assert token_lps == pytest.approx(expected, abs=DENSE_LOGPROB_TOL)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_logprobs(stack, engine, model_dir, stream):
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    ref_ids, ref_lp = engine(_chat_ids(), body, chat=True)
    if stream:
        content = streamed_choices(sse_stream(stack, "/v1/chat/completions", body), True)[0]["lp"]
    else:
        content = post_json(f"{stack.url}/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ref_lp)
    for entry, e in zip(content, ref_lp, strict=True):
        assert entry["logprob"] == pytest.approx(e.logprob, abs=1e-4)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([lp for _, lp in e.top], abs=1e-4)
        assert isinstance(entry["bytes"], list) and len(entry["top_logprobs"]) == 2
    _match_the_dense_oracle(model_dir, _chat_ids(), ref_ids, [entry["logprob"] for entry in content])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_echo_prepends_the_prompt(stack, greedy, stream):
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "echo": True}
    if stream:
        text = streamed_choices(sse_stream(stack, "/v1/completions", body), False)[0]["text"]
    else:
        text = post_json(f"{stack.url}/v1/completions", body)["choices"][0]["text"]
    assert text == PROMPT + greedy[False]["text"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_include_usage_and_max_tokens(stack, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **({"messages": MESSAGES} if chat else {"prompt": PROMPT}),
    }
    events = sse_stream(stack, path, body)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    assert all(e["choices"] for e in events[:-1]) and "usage" not in events[0]
    without = sse_stream(stack, path, {k: v for k, v in body.items() if k != "stream_options"})
    assert all(e["choices"] for e in without)


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ("/v1/completions", {"prompt": "x", "stop": ""}, "stop"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MESSAGES, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "a"}]}, "messages[0].name"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(stack, path, body, field):
    status, data = post_status(stack, path, body)
    assert status == 400, data
    assert data["error"]["message"].startswith(f"{field}: ") and data["error"]["param"] == field, data


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "tools": []}, "tools"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "wat": 1}, "wat"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
    ],
)
def test_the_decode_refuses_directly_too(stack, body, field):
    c = stack.cfg
    ktp = {"do_remote_prefill": True, "metaserver": f"{stack.url}/v1/metaserver", "request_id": "direct"}
    req = urllib.request.Request(
        f"http://{c.host}:{c.decode_ports[0]}/v1/completions",
        data=json.dumps({**body, "kv_transfer_params": ktp}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=30)
    assert exc.value.code == 400
    assert json.loads(exc.value.read())["error"]["message"].startswith(f"{field}: ")


def test_the_proxy_and_the_prefill_derive_the_same_choice_seeds():
    """The seed the proxy gives each choice's decode is the one the prefill samples that choice's
    first token with."""
    from kvoffload_proxy.flow import decoder_body
    from kvoffload_proxy.schemas import parse_inference
    from openai_api.dispatch import parse_dispatch

    for seed in (0, 1, 2**63 - 1):
        raw = json.dumps({"prompt": "x", "n": 4, "seed": seed, "max_tokens": 1}).encode()
        req = parse_inference("completions", raw)
        proxy = [decoder_body(req, j, f"c-{j}", "http://m")["seed"] for j in range(4)]
        prefill = [child.params.seed for child in parse_dispatch(raw, TOK, chat=False, max_model_len=64)]
        assert proxy == prefill == [choice_seed(seed, j) for j in range(4)]
    assert choice_seed(7, 0) == 7 and math.isfinite(choice_seed(7, 3))


def test_the_openapi_document_lists_exactly_the_accepted_fields(stack):
    with urllib.request.urlopen(f"{stack.url}/openapi.json", timeout=10) as r:
        schemas = json.loads(r.read())["components"]["schemas"]
    comp, chat = schemas["CompletionRequest"], schemas["ChatCompletionRequest"]
    assert comp["additionalProperties"] is False and chat["additionalProperties"] is False
    common = {
        "model",
        "stream",
        "stream_options",
        "max_tokens",
        "n",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stop_token_ids",
        "presence_penalty",
        "frequency_penalty",
        "min_tokens",
        "ignore_eos",
        "user",
    }
    assert set(comp["properties"]) == common | {"prompt", "logprobs", "echo", "best_of"}
    assert set(chat["properties"]) == common | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
