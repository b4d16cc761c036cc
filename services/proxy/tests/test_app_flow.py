"""End to end through the real proxy app between an HTTP client and fake prefiller/decoder servers:
what each backend receives (the prefill's shape, the decoders' children), streaming, chat, prompt lists,
and requests spread over the decoders."""

from __future__ import annotations

import asyncio
import re


def _assert_prefill_shape(prefill_body, decoder, child_id, original):
    assert prefill_body["stream"] is False
    assert prefill_body["max_tokens"] == 1  # the client's min_tokens (if any) holds for the first token
    assert prefill_body.get("min_tokens") == original.get("min_tokens")
    assert "stream_options" not in prefill_body
    assert prefill_body["kv_transfer_params"] == decoder.endpoint_params(child_id)
    for k, v in original.items():
        if k not in ("stream", "max_tokens", "stream_options"):
            assert prefill_body[k] == v


async def test_completion_json_prefill_shape_and_metaserver_after_prefill(stack):
    async with stack(prefill_delay_s=0.2) as s:
        body = {"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0.0}
        status, data, r = await s.post("/v1/completions", body, headers={"X-Request-Id": "rq-1"})
        assert status == 200, data
        assert r.headers["X-Request-Id"] == "rq-1"
        assert data["object"] == "text_completion"
        assert data["choices"] == [{"index": 0, "text": "<hi> a b", "finish_reason": "length"}]
        assert data["usage"]["total_tokens"] == 8 and "kv_transfer_params" not in data
        assert re.fullmatch(r"cmpl-[0-9a-f]{32}", data["id"])

        d, p = s.decoders[0], s.prefillers[0]
        ktp = d.received[0]["kv_transfer_params"]
        assert ktp["do_remote_prefill"] is True and ktp["request_id"] == data["id"]
        assert ktp["metaserver"] == f"{s.url}/v1/metaserver"
        assert d.received[0]["prompt"] == "hi" and d.received[0]["max_tokens"] == 5
        assert len(p.received) == 1
        _assert_prefill_shape(p.received[0], d, data["id"], body)
        assert d.headers[0]["X-Request-Id"] == p.headers[0]["X-Request-Id"] == "rq-1"
        status, answer, answered_at = d.metaserver_answers[0]
        assert (status, answer) == (200, {"status": "ok"})
        assert answered_at >= p.done_at[0]  # answered only after the prefill completed
        await s.assert_idle()


async def test_flat_registration_form_is_accepted(stack):
    async with stack(decoders=("flat_registration",)) as s:
        status, data, _ = await s.post("/v1/completions", {"prompt": "hi"})
        assert status == 200, data
        p = s.prefillers[0].received[0]
        assert p["kv_transfer_params"] == s.decoders[0].endpoint_params(data["id"])


async def test_completion_stream_relays_sse_and_drops_stream_options_for_prefill(stack):
    async with stack() as s:
        body = {"prompt": [1, 2, 3], "stream": True, "stream_options": {"include_usage": True}}
        status, events = await s.stream("/v1/completions", body)
        assert status == 200
        assert events[-1] == "[DONE]"
        texts = [e["choices"][0]["text"] for e in events[:-2]]
        assert texts == ["<[1, 2, 3]>", " a", " b"]
        assert events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] == 8
        assert len({e["id"] for e in events[:-1]}) == 1
        p = s.prefillers[0].received[0]
        assert p["prompt"] == [1, 2, 3]
        _assert_prefill_shape(p, s.decoders[0], events[0]["id"], {"prompt": [1, 2, 3]})
        await s.assert_idle()


async def test_chat_stream_and_json(stack):
    async with stack() as s:
        msgs = [{"role": "user", "content": "hello"}]
        status, events = await s.stream(
            "/v1/chat/completions", {"messages": msgs, "stream": True, "max_completion_tokens": 7}
        )
        assert status == 200
        assert [e["choices"][0]["delta"]["content"] for e in events[:-1]] == ["<chat>", " a", " b"]
        assert events[0]["object"] == "chat.completion.chunk"
        assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", events[0]["id"])
        p = s.prefillers[0]
        assert p.paths == ["/v1/chat/completions"]
        assert p.received[0]["messages"] == msgs and "max_completion_tokens" not in p.received[0]
        assert p.received[0]["max_tokens"] == 1 and p.received[0]["stream"] is False

        status, data, _ = await s.post("/v1/chat/completions", {"messages": msgs})
        assert status == 200
        assert data["choices"][0]["message"]["content"] == "<chat> a b"
        await s.assert_idle()


async def test_prompt_list_children_and_one_batched_prefill(stack):
    async with stack(decoders=("ok", "ok")) as s:
        prompts = ["p0", "p1", "p2"]
        status, data, _ = await s.post("/v1/completions", {"prompt": prompts, "max_tokens": 3})
        assert status == 200, data
        assert [c["index"] for c in data["choices"]] == [0, 1, 2]
        assert [c["text"] for c in data["choices"]] == ["<p0> a b", "<p1> a b", "<p2> a b"]
        assert data["usage"]["total_tokens"] == 24

        sent = [(d, b) for d in s.decoders for b in d.received]
        assert len(sent) == 3 and {len(d.received) for d in s.decoders} == {1, 2}
        child_ids = {b["prompt"]: b["kv_transfer_params"]["request_id"] for _, b in sent}
        for i, prompt in enumerate(prompts):
            assert child_ids[prompt] == f"{data['id']}-{i}"
        assert re.fullmatch(r"cmpl-[0-9a-f]{32}-0", child_ids["p0"])

        p = s.prefillers[0].received
        assert len(p) == 1, "one batched prefill for all children"
        assert p[0]["prompt"] == prompts and "kv_transfer_params" not in p[0]
        by_child = {b["kv_transfer_params"]["request_id"]: d for d, b in sent}
        assert p[0]["kv_transfer_params_list"] == [
            by_child[c].endpoint_params(c) for c in (f"{data['id']}-{i}" for i in range(3))
        ]
        assert p[0]["max_tokens"] == 1 and p[0]["stream"] is False
        await s.assert_idle()


async def test_prompt_list_streaming_merges_indices(stack):
    async with stack(decoders=("ok", "ok")) as s:
        status, events = await s.stream("/v1/completions", {"prompt": ["a", "b"], "stream": True, "n": 1})
        assert status == 200 and events[-1] == "[DONE]"
        by_index: dict[int, str] = {}
        for e in events[:-1]:
            c = e["choices"][0]
            by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
        assert by_index == {0: "<a> a b", 1: "<b> a b"}
        assert len(s.prefillers[0].received) == 1


async def test_concurrent_requests_spread_over_decoders(stack):
    async with stack(prefillers=("ok", "ok"), decoders=("slow", "slow")) as s:
        reqs = [s.stream("/v1/completions", {"prompt": "x" * 40, "stream": True}) for _ in range(4)]
        results = await asyncio.gather(*reqs)
        assert all(st == 200 and ev[-1] == "[DONE]" for st, ev in results)
        assert [len(d.received) for d in s.decoders] == [2, 2]
        assert sorted(len(p.received) for p in s.prefillers) == [2, 2]
        await s.assert_idle()
