"""Validation at the edge: strict types, messages naming the field."""

import json

import pytest

from kvoffload_proxy.errors import ProxyError
from kvoffload_proxy.schemas import ChatCompletionRequest, CompletionRequest, estimate_tokens, parse_inference
from openai_api.fields import CHAT_FIELDS, COMPLETION_FIELDS


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
    "kind, body, fragment",
    [
        ("completions", {}, "field 'prompt' is required"),
        ("completions", {"prompt": None}, "field 'prompt' must be"),
        ("completions", {"prompt": [1, "a"]}, "field 'prompt' must be"),
        ("completions", {"prompt": [[]]}, "field 'prompt' must be"),
        ("completions", {"prompt": [-1]}, "field 'prompt' must be"),
        ("completions", {"prompt": [True]}, "field 'prompt' must be"),
        ("completions", {"prompt": "x", "n": 0}, "field 'n'"),
        ("completions", {"prompt": "x", "max_tokens": "5"}, "field 'max_tokens'"),
        ("completions", {"prompt": "x", "max_tokens": 1.5}, "field 'max_tokens'"),
        ("completions", {"prompt": "x", "stream": 1}, "field 'stream'"),
        ("completions", {"prompt": "x", "stream_options": []}, "field 'stream_options'"),
        ("completions", {"prompt": "x", "model": 3}, "field 'model'"),
        ("chat", {"messages": []}, "field 'messages'"),
        ("chat", {"messages": "hi"}, "field 'messages'"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "field 'messages[0].content' must"),
        ("chat", {"messages": [{"role": "", "content": "x"}]}, "field 'messages[0].role'"),
    ],
)
def test_invalid_bodies(kind, body, fragment):
    with pytest.raises(ProxyError) as e:
        _parse(kind, body)
    assert e.value.status == 400 and fragment in e.value.message, e.value.message


@pytest.mark.parametrize("raw", [b"", b"{", b"null", b'"x"', b"[]", b'{"prompt": Infinity}', b"[" * 100000])
def test_invalid_json(raw):
    with pytest.raises(ProxyError) as e:
        parse_inference("completions", raw)
    assert e.value.status == 400


def test_token_estimates():
    assert estimate_tokens("") == 1 and estimate_tokens("x" * 41) == 11
    assert estimate_tokens([1, 2, 3]) == 3


def test_the_schemas_accept_exactly_the_fields_the_engine_accepts():
    """openai_api.fields is the list; the proxy's schemas type each field of it (the P/D wiring is
    the proxy's own to set)."""
    wiring = {"kv_transfer_params", "kv_transfer_params_list"}
    assert set(CompletionRequest.model_fields) == COMPLETION_FIELDS - wiring
    assert set(ChatCompletionRequest.model_fields) == CHAT_FIELDS - wiring
