"""The one parse of a request body (decode, offload-only prefill) and of the proxy's prefill
dispatch: JSON, the checks, the request; every refusal a RequestError naming the field."""

import json

import pytest

from dsamodel.tokenizer import ByteTokenizer
from openai_api.body import RequestError
from openai_api.dispatch import parse_dispatch
from openai_api.request import parse_request
from openai_api.sampling_params import choice_seed

TOK = ByteTokenizer()
KTP = {"do_remote_prefill": True, "metaserver": "http://m", "request_id": "c"}


def _raw(body):
    return json.dumps(body).encode()


def test_a_request_parses_to_its_prompt_params_and_wiring():
    req = parse_request(
        _raw(
            {
                "prompt": "ab",
                "max_tokens": 3,
                "stream": True,
                "kv_transfer_params": KTP,
                "stream_options": {"include_usage": True},
            }
        ),
        TOK,
        chat=False,
        max_model_len=64,
    )
    assert req.prompt_ids == TOK.encode("ab", add_bos=True) and req.params.max_tokens == 3
    assert req.stream and req.include_usage and req.transfer.metaserver == "http://m"
    assert parse_request(_raw({"prompt": "ab"}), TOK, chat=False, max_model_len=64).transfer is None


@pytest.mark.parametrize(
    "raw, start",
    [
        (b"{not json", "body: not valid JSON (Expecting property name"),
        (b"\xff\xfe{", "body: not valid JSON ("),
        (b'{"prompt": NaN}', "body: not valid JSON (NaN is not valid JSON)"),
        (b"[1]", "body: must be a JSON object, got an array"),
        (_raw({"prompt": "x", "n": 2}), "n: this service returns one choice per request (got n=2)"),
        (_raw({"prompt": ["x", "y"]}), "prompt: this service takes one prompt per request"),
        (_raw({"prompt": "x", "max_tokens": 60}), "prompt (2 tokens) + max_tokens (60) exceeds max_model_len=32"),
        (_raw({"prompt": "x", "kv_transfer_params": {"remote_port": "1"}}), "kv_transfer_params.remote_port:"),
        (_raw({"prompt": "x", "tools": []}), "tools: not supported"),
    ],
)
def test_refusals_name_the_field(raw, start):
    with pytest.raises(RequestError) as e:
        parse_request(raw, TOK, chat=False, max_model_len=32)
    assert str(e.value).startswith(start), e.value


def test_a_mode_s_own_refusals_come_first():
    def refuse(body):
        raise RequestError("n: one choice here")

    with pytest.raises(RequestError, match="^n: one choice here"):
        parse_request(_raw({"prompt": "x", "frobnicate": 1}), TOK, chat=False, max_model_len=32, refuse=refuse)


def test_a_dispatch_is_prompt_times_choice_each_with_its_seed_and_decode():
    ktps = [{"request_id": f"c-{k}", "remote_host": "h", "remote_port": 100 + k} for k in range(4)]
    children = parse_dispatch(
        _raw({"prompt": ["a", "bb"], "n": 2, "seed": 5, "max_tokens": 1, "kv_transfer_params_list": ktps}),
        TOK,
        chat=False,
        max_model_len=64,
    )
    assert [len(c.prompt_ids) for c in children] == [2, 2, 3, 3]
    assert [c.params.seed for c in children] == [choice_seed(5, j) for j in (0, 1, 0, 1)]
    assert [c.transfer.request_id for c in children] == ["c-0", "c-1", "c-2", "c-3"]
    one = parse_dispatch(
        _raw({"prompt": [1, 2], "max_tokens": 1, "kv_transfer_params": ktps[0]}), TOK, chat=False, max_model_len=64
    )
    assert len(one) == 1 and one[0].prompt_ids == [1, 2] and one[0].transfer.remote_port == 100
    chat = parse_dispatch(
        _raw({"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}), TOK, chat=True, max_model_len=64
    )
    assert len(chat) == 1 and chat[0].transfer is None


@pytest.mark.parametrize(
    "body, start",
    [
        ({"prompt": ["a", "b"], "kv_transfer_params_list": "x"}, "kv_transfer_params_list: must give one entry"),
        ({"prompt": ["a", "b"], "kv_transfer_params_list": [None]}, "kv_transfer_params_list: must give one entry"),
        ({"prompt": "a", "kv_transfer_params_list": [5]}, "kv_transfer_params_list[0]: must be an object"),
        ({"prompt": "x" * 70}, "prompt of 71 tokens exceeds max_model_len=64"),
    ],
)
def test_dispatch_refusals_name_the_field(body, start):
    with pytest.raises(RequestError) as e:
        parse_dispatch(_raw(body), TOK, chat=False, max_model_len=64)
    assert str(e.value).startswith(start), e.value
