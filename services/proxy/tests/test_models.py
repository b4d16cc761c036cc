"""GET /v1/models through the official OpenAI Python client: the decoders' served model names,
merged and de-duplicated, behind the API key when one is set; a decoder that does not answer is
left out, none answering is a 503; the list is cached briefly, one refresh at a time."""

from __future__ import annotations

import asyncio

import openai
import pytest

from kvoffload_proxy.app import MODELS
from kvoffload_proxy.models import parse_model_list

KEY = "sekret-key"


def client(s, api_key: str = "no-key-needed") -> openai.AsyncOpenAI:
    """The client as users configure it: base_url ends in /v1; no retries, so a 5xx shows as is."""
    return openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key=api_key, max_retries=0, timeout=10)


async def test_openai_client_lists_the_decoders_models(stack):
    async with stack(decoders=("ok", "ok", "ok")) as s:
        s.decoders[1].model = "other-model"  # d0 and d2 serve "m": listed once, in decoder order
        async with client(s) as c:
            page = await c.models.list()
            assert [m.id for m in page.data] == ["m", "other-model"]
            assert all(m.object == "model" and m.owned_by == "fake" and m.created == 1700000000 for m in page.data)
            assert [m.id async for m in c.models.list()] == ["m", "other-model"]  # the paginator too
            done = await c.completions.create(model=page.data[0].id, prompt="hi", max_tokens=3)
            assert done.model == "m" and done.choices[0].text == "<hi> a b"  # an id it listed works
        assert all(len(d.model_queries) == 1 for d in s.decoders)  # the second list came from the cache


async def test_openai_client_with_the_api_key(stack):
    async with stack(args=["--api-key", KEY]) as s:
        async with client(s, KEY) as c:
            assert [m.id for m in (await c.models.list()).data] == ["m"]
        for wrong in ("wrong-key", KEY + "x"):
            async with client(s, wrong) as c:
                with pytest.raises(openai.AuthenticationError) as e:
                    await c.models.list()
            assert e.value.status_code == 401
            assert e.value.body["type"] == "authentication_error" and KEY not in str(e.value.body)
        async with s.http.get(s.url + "/v1/models") as r:  # no Authorization header at all
            assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
        assert len(s.decoders[0].model_queries) == 1  # refused calls never reached a decoder
        assert KEY not in str(s.decoders[0].model_queries[0])  # decoders never see the client key


async def test_a_decoder_that_does_not_answer_is_left_out(stack):
    async with stack(decoders=("no_models", "hang", "ok"), down_decoders=1, args=["--health-timeout-s", "0.5"]) as s:
        s.decoders[2].model = "only-this-one"
        async with client(s) as c:
            assert [m.id for m in (await c.models.list()).data] == ["only-this-one"]


async def test_no_decoder_answering_is_a_503_naming_them(stack):
    async with stack(decoders=("no_models",), down_decoders=1) as s:
        async with client(s) as c:
            with pytest.raises(openai.InternalServerError) as e:
                await c.models.list()
        assert e.value.status_code == 503
        message = e.value.body["message"]
        assert "no decoder answered GET /v1/models" in message and "HTTP 404" in message
        assert s.decoders[0].url in message and str(s.config.decoders[1].port) in message
        assert e.value.response.headers["Retry-After"] == "1"
        async with client(s) as c:  # failures are not cached: the decoder is asked again
            with pytest.raises(openai.InternalServerError):
                await c.models.list()
        assert len(s.decoders[0].model_queries) == 2


async def test_cached_briefly_and_refreshed_once_for_concurrent_callers(stack):
    async with stack() as s:
        d = s.decoders[0]
        d.delay_s = 0.3
        async with client(s) as c:
            pages = await asyncio.gather(*(c.models.list() for _ in range(5)))
            assert all([m.id for m in p.data] == ["m"] for p in pages)
            assert len(d.model_queries) == 1  # one refresh shared by the five callers
            d.model = "renamed"
            assert [m.id for m in (await c.models.list()).data] == ["m"]  # cached
            s.app[MODELS].ttl_s = 0  # expire it
            assert [m.id for m in (await c.models.list()).data] == ["renamed"]
        assert len(d.model_queries) == 2  # the gathered five, then the one after expiry
        assert "X-Request-Id" in d.model_queries[0]  # the triggering request's id is forwarded


def test_parse_model_list_normalizes_entries():
    text = (
        '{"object": "list", "data": [{"id": "a", "object": "model", "created": 5, "owned_by": "vllm",'
        ' "max_model_len": 8192}, {"id": "b"}, {"id": "c", "created": -1, "owned_by": ""}]}'
    )
    assert parse_model_list(text, 42) == [
        {"id": "a", "object": "model", "created": 5, "owned_by": "vllm", "max_model_len": 8192},
        {"id": "b", "object": "model", "created": 42, "owned_by": "kvoffload"},
        {"id": "c", "object": "model", "created": 42, "owned_by": "kvoffload"},
    ]
    assert parse_model_list('{"data": []}', 42) == []


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '{"object": "list"}',
        '{"data": {}}',
        '{"data": [{"id": 3}]}',
        '{"data": [{"id": ""}]}',
        '{"data": ["m"]}',
        "not json",
    ],
)
def test_parse_model_list_rejects_what_is_not_a_model_list(text):
    with pytest.raises(ValueError):
        parse_model_list(text, 0)
