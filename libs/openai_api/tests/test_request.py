"""openai_api.body and .request: strict bodies (a 400 naming the field) and the parameters they map to."""

import pytest

from dsamodel.tokenizer import ByteTokenizer
from openai_api.body import RequestError, check_body
from openai_api.logprobs import TokenLogprob, chat_logprobs, completion_logprobs, token_text
from openai_api.request import prompt_ids, sampling_params
from openai_api.sampling_params import choice_seed

TOK = ByteTokenizer()
MSG = [{"role": "user", "content": "hi"}]


def test_parameters_map_to_sampling_params():
    p = sampling_params(
        {
            "prompt": "x",
            "max_tokens": 9,
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 3,
            "stop": "7",
            "stop_token_ids": [1],
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "min_tokens": 2,
            "ignore_eos": True,
            "logprobs": 2,
        }
    )
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop, p.stop_token_ids) == (9, 0.5, 0.9, 3, ("7",), (1,))
    assert (p.presence_penalty, p.frequency_penalty, p.min_tokens, p.ignore_eos, p.logprobs) == (0.5, -1, 2, True, 2)
    chat = sampling_params(
        {"messages": MSG, "max_tokens": 3, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 4}, chat=True
    )
    assert chat.max_tokens == 5 and chat.logprobs == 4
    assert sampling_params({"messages": MSG, "logprobs": False}, chat=True).logprobs is None
    nulls = sampling_params({"prompt": "x", "stop": None, "seed": None, "logprobs": None, "max_tokens": None})
    assert nulls.stop == () and nulls.seed == 0 and nulls.logprobs is None and nulls.max_tokens == 16


def test_choice_seeds():
    assert choice_seed(5, 0) == 5
    assert len({choice_seed(5, j) for j in range(8)}) == 8
    assert sampling_params({"prompt": "x", "seed": 5}, choice=2).seed == choice_seed(5, 2)


@pytest.mark.parametrize(
    "body, chat, field",
    [
        ({"prompt": "x", "tools": []}, False, "tools"),
        ({"prompt": "x", "frobnicate": 1}, False, "frobnicate"),
        ({"prompt": "x", "n": 2}, False, "n"),
        ({"prompt": "x", "best_of": 2}, False, "best_of"),
        ({"prompt": "x", "echo": True, "logprobs": 0}, False, "echo"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, False, "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": {"x": 1}}, False, "stream_options.x"),
        ({"messages": MSG, "echo": True}, True, "echo"),
        ({"messages": MSG, "top_logprobs": 1}, True, "top_logprobs"),
        ({"messages": MSG, "response_format": {}}, True, "response_format"),
    ],
)
def test_check_body_refuses_by_name(body, chat, field):
    with pytest.raises(RequestError, match=f"^{field}"):
        check_body(body, chat=chat)
        sampling_params(body, chat=chat)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"stop": ""}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_bad_values(body, field):
    with pytest.raises(RequestError, match=f"^{field}"):
        sampling_params({"prompt": "x", **body})


def test_prefill_takes_min_tokens_above_its_one_token():
    assert sampling_params({"prompt": "x", "max_tokens": 1, "min_tokens": 4}, first_token_only=True).min_tokens == 4
    check_body({"prompt": "x", "n": 3}, chat=False, max_n=None)


def test_chat_content_parts_and_roles():
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert prompt_ids({"messages": parts}, TOK, chat=True) == prompt_ids({"messages": MSG}, TOK, chat=True)
    with pytest.raises(RequestError, match=r"^messages\[0\].content"):
        prompt_ids({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, TOK, chat=True)
    with pytest.raises(RequestError, match=r"^messages\[0\].role"):
        prompt_ids({"messages": [{"role": "tool", "content": "x"}]}, TOK, chat=True)
    with pytest.raises(RequestError, match=r"^messages\[0\].name"):
        prompt_ids({"messages": [{"role": "user", "content": "x", "name": "n"}]}, TOK, chat=True)


def test_logprob_shapes():
    e = [TokenLogprob(ord("a"), -0.5, ((ord("a"), -0.5), (0xC3, -2.0))), TokenLogprob(257, -1.0, ())]
    comp = completion_logprobs(TOK, e, [0, 1])
    assert comp["tokens"] == ["a", "<|eos|>"] and comp["token_logprobs"] == [-0.5, -1.0]
    assert comp["top_logprobs"] == [{"a": -0.5, "bytes:\\xc3": -2.0}, {"<|eos|>": -1.0}]
    assert comp["text_offset"] == [0, 1]
    chat = chat_logprobs(TOK, e)["content"]
    assert chat[0] == {
        "token": "a",
        "logprob": -0.5,
        "bytes": [97],
        "top_logprobs": [
            {"token": "a", "logprob": -0.5, "bytes": [97]},
            {"token": "bytes:\\xc3", "logprob": -2.0, "bytes": [0xC3]},
        ],
    }
    assert token_text(TOK, 0xE2) == "bytes:\\xe2"
