"""openai_api.body, .body_types and .request: strict bodies (a refusal naming the field, stating the
rule) and the parameters they map to."""

import pytest

from dsamodel.tokenizer import ByteTokenizer
from openai_api.body import RequestError, validate_body
from openai_api.logprobs import TokenLogprob, chat_logprobs, completion_logprobs, token_text
from openai_api.request import prompt_ids
from openai_api.sampling_params import choice_seed

TOK = ByteTokenizer()
MSG = [{"role": "user", "content": "hi"}]


def sampling_params(body, *, chat=False, choice=0, first_token_only=False):
    return validate_body(body, chat=chat, first_token_only=first_token_only).sampling_params(choice)


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
    assert sampling_params({"prompt": "x", "max_tokens": 3.0, "stream": None, "n": None}).max_tokens == 3


def test_choice_seeds():
    assert choice_seed(5, 0) == 5
    assert len({choice_seed(5, j) for j in range(8)}) == 8
    assert sampling_params({"prompt": "x", "seed": 5}, choice=2).seed == choice_seed(5, 2)


@pytest.mark.parametrize(
    "body, chat, message",
    [
        ({"prompt": "x", "tools": []}, False, "tools: not supported by this server on /v1/completions"),
        ({"prompt": "x", "frobnicate": 1}, False, "frobnicate: unknown parameter"),
        ({"prompt": "x", "best_of": 2}, False, "best_of: only best_of == n is supported (got best_of=2, n=1)"),
        ({"prompt": "x", "echo": True, "logprobs": 0}, False, "echo: echo together with logprobs"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, False, "stream_options: only allowed with stream"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"x": 1}},
            False,
            "stream_options.x: unknown parameter (stream_options takes include_usage)",
        ),
        ({"messages": MSG, "echo": True}, True, "echo: not supported by this server on /v1/chat/completions"),
        ({"messages": MSG, "top_logprobs": 1}, True, "top_logprobs: needs logprobs: true"),
        ({"messages": MSG, "response_format": {}}, True, "response_format: not supported"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, False, "min_tokens: 5 exceeds max_tokens (2)"),
        ({"messages": MSG, "min_tokens": 5, "max_completion_tokens": 2}, True, "min_tokens: 5 exceeds max_tokens (2)"),
    ],
)
def test_refused_by_name_and_combinations(body, chat, message):
    with pytest.raises(RequestError) as e:
        validate_body(body, chat=chat)
    assert str(e.value).startswith(message), e.value


@pytest.mark.parametrize(
    "body, message",
    [
        ({"stop": ""}, "stop: must be a non-empty string or a list of 1 to 16 non-empty strings, got ''"),
        ({"stop": ["a", 3]}, "stop: must be a non-empty string or a list of 1 to 16"),
        ({"stop": ["a"] * 17}, "stop: must be a non-empty string or a list of 1 to 16"),
        ({"presence_penalty": 3}, "presence_penalty: must be a number in [-2, 2]"),
        ({"logprobs": 21}, "logprobs: must be an integer in [0, 20]"),
        ({"seed": -1}, "seed: must be an integer in [0, 2**63)"),
        ({"seed": 2**63}, "seed: must be an integer in [0, 2**63)"),
        ({"stop_token_ids": [-1]}, "stop_token_ids: must be a list of token ids"),
        ({"temperature": "hot"}, "temperature: must be a number in [0, 2] (default 1), got 'hot'"),
        ({"temperature": True}, "temperature: must be a number in [0, 2]"),
        ({"top_p": 0}, "top_p: must be a number in (0, 1]"),
        ({"ignore_eos": 1}, "ignore_eos: must be a boolean, got 1"),
        ({"max_tokens": 1.5}, "max_tokens: must be an integer >= 1"),
        ({"max_tokens": "5"}, "max_tokens: must be an integer >= 1"),
        ({"n": 65}, "n: must be an integer in [1, 64]"),
        ({"model": 3}, "model: must be a string, got 3"),
        ({"prompt": ""}, "prompt: must be a non-empty string"),
        ({"prompt": [True]}, "prompt: must be a non-empty string"),
    ],
)
def test_bad_values_name_the_field_and_state_the_rule(body, message):
    with pytest.raises(RequestError) as e:
        validate_body({"prompt": "x", **body}, chat=False)
    assert str(e.value).startswith(message), e.value


def test_a_long_value_is_shown_cut():
    with pytest.raises(RequestError) as e:
        validate_body({"prompt": "x", "stop": ["s" * 1000, ""]}, chat=False)
    assert str(e.value).endswith("...") and len(str(e.value)) < 200


def test_prefill_takes_min_tokens_above_its_one_token():
    body = {"prompt": "x", "max_tokens": 1, "min_tokens": 4}
    assert sampling_params(body, first_token_only=True).min_tokens == 4
    with pytest.raises(RequestError, match="^min_tokens"):
        validate_body(body, chat=False)
    assert validate_body({"prompt": "x", "n": 3}, chat=False).choices == 3


def test_chat_content_parts_and_roles():
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    chat = prompt_ids(validate_body({"messages": parts}, chat=True), TOK)
    assert chat == prompt_ids(validate_body({"messages": MSG}, chat=True), TOK)
    for messages, message in [
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content: must be a string or a list"),
        ([{"role": "tool", "content": "x"}], "messages[0].role: must be system, user or assistant, got 'tool'"),
        ([{"role": "user", "content": "x", "name": "n"}], "messages[0].name: not supported by this server"),
        ([MSG[0], {"content": "x"}], "messages[1].role: required (system, user or assistant)"),
        ([MSG[0], {"role": "user", "content": "x", "z": 1}], "messages[1].z: unknown parameter (messages[1] takes"),
        ([5], "messages: must be a non-empty list of messages {role, content}, got [5]"),
        ([], "messages: must be a non-empty list"),
    ]:
        with pytest.raises(RequestError) as e:
            validate_body({"messages": messages}, chat=True)
        assert str(e.value).startswith(message), e.value


def test_prompt_forms_and_the_vocabulary():
    assert prompt_ids(validate_body({"prompt": [1, 2]}, chat=False), TOK) == [[1, 2]]
    assert prompt_ids(validate_body({"prompt": [[3], [4, 5]]}, chat=False), TOK) == [[3], [4, 5]]
    with pytest.raises(RequestError, match="^prompt: must be"):
        validate_body({"prompt": ["a", [3]]}, chat=False)
    with pytest.raises(RequestError, match=r"^prompt: token id 9999 outside the vocabulary"):
        prompt_ids(validate_body({"prompt": [1, 9999]}, chat=False), TOK)


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
