"""The proxy's half of issue 11: the exact accepted set (400 naming the field), n as child requests."""

import json

import pytest

from kvoffload_proxy.errors import ProxyError
from kvoffload_proxy.flow import decoder_body, prefill_body
from kvoffload_proxy.relay import StreamRelay
from kvoffload_proxy.schemas import parse_inference
from openai_api.sampling_params import choice_seed
from openai_api.transfer_params import KVTransferParams

MSG = [{"role": "user", "content": "hi"}]


def _parse(kind, body):
    return parse_inference(kind, json.dumps(body).encode())


@pytest.mark.parametrize(
    "kind, body, start",
    [
        ("completions", {"prompt": "x", "frobnicate": 1}, "frobnicate: unknown parameter"),
        ("completions", {"prompt": "x", "suffix": "y"}, "suffix: not supported by this server on /v1/completions"),
        ("completions", {"prompt": "x", "logit_bias": {}}, "logit_bias: not supported"),
        ("completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs: not supported"),
        ("completions", {"prompt": "x", "best_of": 3, "n": 2}, "best_of: only best_of == n is supported"),
        ("completions", {"prompt": "x", "echo": True, "logprobs": 0}, "echo: echo together with logprobs"),
        ("completions", {"prompt": "x", "logprobs": 21}, "logprobs: must be an integer in [0, 20]"),
        ("completions", {"prompt": "x", "stop": ""}, "stop: must be"),
        ("completions", {"prompt": "x", "stop": ["a"] * 17}, "stop: must be"),
        ("completions", {"prompt": "x", "min_tokens": 20}, "min_tokens: 20 exceeds max_tokens (16)"),
        ("completions", {"prompt": "x", "seed": -1}, "seed: must be an integer in [0, 2**63)"),
        ("completions", {"prompt": "x", "temperature": 3}, "temperature: must be a number in [0, 2]"),
        ("completions", {"prompt": "x", "presence_penalty": -2.5}, "presence_penalty: must be a number in [-2, 2]"),
        ("completions", {"prompt": "x", "n": 65}, "n: must be an integer in [1, 64]"),
        ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options: only allowed"),
        (
            "completions",
            {"prompt": "x", "stream": True, "stream_options": {"x": 1}},
            "stream_options.x: unknown parameter (stream_options takes include_usage)",
        ),
        ("chat", {"messages": MSG, "tools": []}, "tools: not supported by this server on /v1/chat/completions"),
        ("chat", {"messages": MSG, "response_format": {"type": "json_object"}}, "response_format: not supported"),
        ("chat", {"messages": MSG, "echo": True}, "echo: not supported"),
        ("chat", {"messages": MSG, "top_logprobs": 1}, "top_logprobs: needs logprobs"),
        ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role: must be"),
        ("chat", {"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name: not supported"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content: must be"),
    ],
)
def test_refused_by_name(kind, body, start):
    with pytest.raises(ProxyError) as e:
        _parse(kind, body)
    assert e.value.status == 400 and e.value.message.startswith(start), e.value.message
    assert e.value.param == start.partition(":")[0]


def test_accepted_set_and_nulls():
    """Every accepted field parses to the request the proxy forwards: the body as sent, and what the
    proxy itself reads from it (stream, n, the children, max_tokens)."""
    body = {
        "prompt": "x",
        "stop": ["a", "b"],
        "stop_token_ids": [1],
        "seed": 3,
        "n": 2,
        "best_of": 2,
        "logprobs": 5,
        "presence_penalty": 1,
        "frequency_penalty": -1.5,
        "min_tokens": 2,
        "ignore_eos": True,
        "user": "u",
        "temperature": 1,
        "top_p": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = _parse("completions", body)
    assert req.body == body and req.kind == "completions" and not req.is_batch
    assert (req.stream, req.n, req.prompts, req.max_tokens) == (True, 2, ("x", "x"), 16)  # 16: the API's default
    req = _parse("completions", {"prompt": [1, 2], "echo": True})
    assert req.body == {"prompt": [1, 2], "echo": True} and req.prompts == ([1, 2],) and req.num_prompt_tokens == (2,)
    chat = {
        "messages": [{"role": "system", "content": [{"type": "text", "text": "s"}]}] + MSG,
        "logprobs": True,
        "top_logprobs": 3,
        "max_completion_tokens": 4,
        "stop": "x",
    }
    req = _parse("chat", chat)
    assert req.body == chat and req.kind == "chat" and (req.stream, req.n, req.max_tokens) == (False, 1, 4)
    nulls = {"prompt": "x", "stop": None, "logprobs": None, "seed": None, "user": None}
    req = _parse("completions", nulls)
    assert req.body == nulls and (req.stream, req.n, req.prompts, req.max_tokens) == (False, 1, ("x",), 16)


def test_n_makes_one_child_per_choice():
    req = _parse("completions", {"prompt": ["a", "bb"], "n": 3, "seed": 5, "best_of": 3})
    assert req.num_children == 6 and req.prompts == ("a",) * 3 + ("bb",) * 3
    bodies = [decoder_body(req, i, f"c-{i}", "http://m") for i in range(6)]
    assert [b["prompt"] for b in bodies] == ["a", "a", "a", "bb", "bb", "bb"]
    assert all(b["n"] == 1 and "best_of" not in b for b in bodies)
    assert [b["seed"] for b in bodies] == [choice_seed(5, j) for j in range(3)] * 2
    assert bodies[0]["seed"] == 5
    pre = prefill_body(req, [KVTransferParams(request_id=f"c-{i}") for i in range(6)])
    assert (
        pre["n"] == 3 and pre["seed"] == 5 and pre["prompt"] == ["a", "bb"] and len(pre["kv_transfer_params_list"]) == 6
    )
    chat = _parse("chat", {"messages": MSG, "n": 2, "min_tokens": 3})
    pre = prefill_body(chat, [KVTransferParams(request_id="a"), KVTransferParams(request_id="b")])
    assert "kv_transfer_params_list" in pre and pre["min_tokens"] == 3 and pre["max_tokens"] == 1


async def test_streamed_usage_counts_each_prompt_once():
    relay = StreamRelay(None, "r", {}, n=2, write_timeout_s=1)
    for child in range(4):
        await relay.add(
            child,
            {
                "object": "text_completion",
                "choices": [],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13},
            },
        )
    assert relay.usage == {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32}
