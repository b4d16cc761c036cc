"""Validation at the edge (openai_api's one validation): strict types, messages naming the field,
the field as the error's ``param``; what the proxy reads of a body; the OpenAPI schemas derived from
openai_api's models."""

import json

import pytest
from pydantic import BaseModel

from kvoffload_proxy import schemas
from kvoffload_proxy.errors import ProxyError
from kvoffload_proxy.openapi import build_openapi
from kvoffload_proxy.schemas import estimate_tokens, parse_inference
from openai_api.body_types import ChatCompletionRequest, CompletionRequest


def _parse(kind, body):
    return parse_inference(kind, json.dumps(body).encode())


def test_single_prompt_forms():
    for prompt in ("hello", [1, 2, 3]):
        req = _parse("completions", {"prompt": prompt, "max_tokens": 4})
        assert not req.is_batch and req.prompts == (prompt,) and req.max_tokens == 4


def test_prompt_lists_are_batches():
    req = _parse("completions", {"prompt": ["a", "bb"]})
    assert req.is_batch and req.prompts == ("a", "bb") and req.num_children == 2
    req = _parse("completions", {"prompt": [[1], [2, 3]]})
    assert req.is_batch and req.num_prompt_tokens == (1, 2)


def test_client_kv_transfer_params_are_dropped_extras_kept():
    req = _parse("completions", {"prompt": "x", "kv_transfer_params": {"evil": 1}, "temperature": 0.5, "seed": 3})
    assert "kv_transfer_params" not in req.body
    assert req.body["temperature"] == 0.5 and req.body["seed"] == 3


def test_chat():
    req = _parse(
        "chat", {"messages": [{"role": "user", "content": "x" * 40}], "max_completion_tokens": 9, "stream": True}
    )
    assert req.stream and req.max_tokens == 9 and req.path == "/v1/chat/completions"
    assert req.num_prompt_tokens == (14,)


@pytest.mark.parametrize(
    "kind, body, start",
    [
        ("completions", {}, "prompt: required (a non-empty string"),
        ("completions", {"prompt": None}, "prompt: must be a non-empty string"),
        ("completions", {"prompt": ""}, "prompt: must be a non-empty string"),
        ("completions", {"prompt": [1, "a"]}, "prompt: must be"),
        ("completions", {"prompt": [[]]}, "prompt: must be"),
        ("completions", {"prompt": [-1]}, "prompt: must be"),
        ("completions", {"prompt": [True]}, "prompt: must be"),
        ("completions", {"prompt": "x", "n": 0}, "n: must be an integer in [1, 64] (default 1), got 0"),
        (
            "completions",
            {"prompt": "x", "max_tokens": "5"},
            "max_tokens: must be an integer >= 1 (default 16), got '5'",
        ),
        ("completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens: must be an integer >= 1"),
        ("completions", {"prompt": "x", "stream": 1}, "stream: must be a boolean, got 1"),
        ("completions", {"prompt": "x", "stream_options": []}, "stream_options: must be an object"),
        ("completions", {"prompt": "x", "model": 3}, "model: must be a string, got 3"),
        ("chat", {"messages": []}, "messages: must be a non-empty list"),
        ("chat", {"messages": "hi"}, "messages: must be a non-empty list"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content: must be"),
        ("chat", {"messages": [{"role": "", "content": "x"}]}, "messages[0].role: must be system, user or assistant"),
    ],
)
def test_invalid_bodies(kind, body, start):
    with pytest.raises(ProxyError) as e:
        _parse(kind, body)
    assert e.value.status == 400 and e.value.message.startswith(start), e.value.message
    assert e.value.param == start.partition(":")[0]


@pytest.mark.parametrize("raw", [b"", b"{", b"null", b'"x"', b"[]", b'{"prompt": Infinity}', b"[" * 100000])
def test_invalid_json(raw):
    with pytest.raises(ProxyError) as e:
        parse_inference("completions", raw)
    assert e.value.status == 400 and e.value.message.startswith("body: ") and e.value.param is None, e.value.message


def test_token_estimates():
    assert estimate_tokens("") == 1 and estimate_tokens("x" * 41) == 11
    assert estimate_tokens([1, 2, 3]) == 3


def test_the_openapi_schemas_are_openai_api_s_models():
    """The proxy types no body of its own: /openapi.json shows openai_api's models, which validate."""
    own = [v for v in vars(schemas).values() if isinstance(v, type) and v.__module__ == schemas.__name__]
    assert [c for c in own if issubclass(c, BaseModel)] == [schemas.MetaserverRegistration]
    components = build_openapi(api_key_required=False)["components"]["schemas"]
    for model in (CompletionRequest, ChatCompletionRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schema.pop("$defs", None)
        assert components[model.__name__] == schema
        assert set(components[model.__name__]["properties"]) == set(model.model_fields)
    assert components["CompletionRequest"]["properties"]["n"]["description"] == "an integer in [1, 64] (default 1)"
