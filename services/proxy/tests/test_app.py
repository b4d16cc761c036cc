"""End to end: the real proxy app between an HTTP client and fake prefiller/decoder servers."""
from __future__ import annotations

import asyncio
import re
import time

import aiohttp

from kvoffload_proxy.app import FLOW


def _assert_prefill_shape(prefill_body, decoder, child_id, original):
    assert prefill_body["stream"] is False
    assert prefill_body["max_tokens"] == 1  # the client's min_tokens (if any) holds for the first token
    assert prefill_body.get("min_tokens") == original.get("min_tokens")
    assert "stream_options" not in prefill_body
    assert prefill_body["kv_transfer_params"] == decoder.endpoint_params(child_id)
    for k, v in original.items():
        if k not in ("stream", "max_tokens", "stream_options"):
            assert prefill_body[k] == v


async def _until(cond, timeout_s=2.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return cond()


async def _assert_idle(s):
    """Nothing leaked: no open rendezvous, no load left on any backend."""
    flow = s.app[FLOW]
    idle = lambda: (len(flow.registry) == 0 and flow.prefillers.is_idle  # noqa: E731
                    and flow.decoders.is_idle and flow.in_flight == 0)
    assert await _until(idle), (len(flow.registry), flow.prefillers.loads, flow.decoders.loads,
                                flow.in_flight)


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
        await _assert_idle(s)


async def test_flat_registration_form_is_accepted(stack):
    async with stack(decoders=("flat_registration",)) as s:
        status, data, _ = await s.post("/v1/completions", {"prompt": "hi"})
        assert status == 200, data
        p = s.prefillers[0].received[0]
        assert p["kv_transfer_params"] == s.decoders[0].endpoint_params(data["id"])


async def test_random_bodies_never_5xx(stack):
    """A seeded mini-fuzz: whatever JSON arrives, the answer is 2xx or 4xx, quickly."""
    import random
    rng = random.Random(1234)
    atoms = [None, True, 0, -1, 1.5, 2**40, "", "x", [], {}, [1, "a"], [[1], []], {"a": 1}]
    keys = ["prompt", "messages", "stream", "max_tokens", "n", "stream_options", "model",
            "request_id", "kv_transfer_params", "role", "content", "max_completion_tokens"]

    def value(depth=0):
        r = rng.random()
        if depth < 2 and r < 0.2:
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        if depth < 2 and r < 0.35:
            return {rng.choice(keys): value(depth + 1) for _ in range(rng.randrange(3))}
        return rng.choice(atoms)

    async with stack(args=["--metaserver-timeout-s", "1"]) as s:
        for k in range(150):
            path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/metaserver"])
            body = {rng.choice(keys): value() for _ in range(rng.randrange(4))}
            t0 = time.monotonic()
            status, data, _ = await s.post(path, body)
            assert status < 500 and time.monotonic() - t0 < 3, (path, body, status, data)
        await _assert_idle(s)


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
        await _assert_idle(s)


async def test_chat_stream_and_json(stack):
    async with stack() as s:
        msgs = [{"role": "user", "content": "hello"}]
        status, events = await s.stream("/v1/chat/completions", {"messages": msgs, "stream": True,
                                                                 "max_completion_tokens": 7})
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
        await _assert_idle(s)


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
            by_child[c].endpoint_params(c) for c in (f"{data['id']}-{i}" for i in range(3))]
        assert p[0]["max_tokens"] == 1 and p[0]["stream"] is False
        await _assert_idle(s)


async def test_prompt_list_streaming_merges_indices(stack):
    async with stack(decoders=("ok", "ok")) as s:
        status, events = await s.stream("/v1/completions", {"prompt": ["a", "b"], "stream": True,
                                                            "n": 1})
        assert status == 200 and events[-1] == "[DONE]"
        by_index: dict[int, str] = {}
        for e in events[:-1]:
            c = e["choices"][0]
            by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
        assert by_index == {0: "<a> a b", 1: "<b> a b"}
        assert len(s.prefillers[0].received) == 1


async def test_concurrent_requests_spread_over_decoders(stack):
    async with stack(prefillers=("ok", "ok"), decoders=("slow", "slow")) as s:
        reqs = [s.stream("/v1/completions", {"prompt": "x" * 40, "stream": True})
                for _ in range(4)]
        results = await asyncio.gather(*reqs)
        assert all(st == 200 and ev[-1] == "[DONE]" for st, ev in results)
        assert [len(d.received) for d in s.decoders] == [2, 2]
        assert sorted(len(p.received) for p in s.prefillers) == [2, 2]
        await _assert_idle(s)


async def test_healthcheck_probes_every_backend(stack):
    async with stack(decoders=("ok", "ok")) as s:
        async with s.http.get(s.url + "/healthcheck") as r:
            assert r.status == 200
            data = await r.json()
        assert len(data["backends"]) == 3 and all(b["ok"] for b in data["backends"])
        await s.decoders[1].stop()
        async with s.http.get(s.url + "/healthcheck") as r:
            assert r.status == 503
            data = await r.json()
        down = [b for b in data["backends"] if not b["ok"]]
        assert [b["url"] for b in down] == [s.decoders[1].url] and down[0]["role"] == "decoder"
    async with stack(prefillers=("unhealthy",)) as s:
        async with s.http.get(s.url + "/healthcheck") as r:
            assert r.status == 503
            assert "HTTP 500" in (await r.json())["backends"][0]["error"]


async def test_reset_prefix_cache_fans_out(stack):
    async with stack(prefillers=("ok", "ok"), decoders=("ok",)) as s:
        status, data, _ = await s.post("/reset_prefix_cache", None)
        assert status == 200 and len(data["backends"]) == 3
        assert [b.resets for b in s.prefillers + s.decoders] == [1, 1, 1]
        await s.prefillers[0].stop()
        status, data, _ = await s.post("/reset_prefix_cache", None)
        assert status == 502
        assert [b["ok"] for b in data["backends"]] == [False, True, True]


async def test_decoder_500_becomes_502(stack):
    async with stack(decoders=("http500",)) as s:
        for stream in (False, True):
            status, data, _ = await s.post("/v1/completions", {"prompt": "hi", "stream": stream})
            assert status == 502, data
            assert s.decoders[0].url in data["error"]["message"]
            assert data["error"]["decoder"] == s.decoders[0].url
        assert s.prefillers[0].received == []
        await _assert_idle(s)


async def test_decoder_400_is_relayed(stack):
    async with stack(decoders=("reject400",)) as s:
        status, data, _ = await s.post("/v1/completions", {"prompt": "very long"})
        assert status == 400
        assert data["error"]["message"] == "prompt is longer than max_model_len"
        await _assert_idle(s)


async def test_prefiller_failure_fails_metaserver_and_client_fast(stack):
    async with stack(prefillers=("http500",)) as s:
        t0 = time.monotonic()
        status, data, _ = await s.post("/v1/completions", {"prompt": "hi", "stream": True})
        assert time.monotonic() - t0 < 3
        assert status == 502, data
        assert data["error"]["prefiller"] == s.prefillers[0].url
        assert "HTTP 500" in data["error"]["message"]
        await _until(lambda: s.decoders[0].metaserver_answers)
        ms_status, ms_body, _ = s.decoders[0].metaserver_answers[0]
        assert ms_status == 502 and ms_body["status"] == "error"
        assert ms_body["prefiller"] == s.prefillers[0].url
        assert "prefill exploded" in ms_body["error"]["message"]
        await _assert_idle(s)


async def test_unreachable_prefiller_is_retried_then_503(stack):
    async with stack(prefillers=(), down_prefillers=1, args=["--max-retries", "2"]) as s:
        status, data, _ = await s.post("/v1/completions", {"prompt": "hi"})
        assert status == 503, data
        assert "after 3 attempt(s)" in data["error"]["message"]
        async with s.http.get(s.url + "/metrics") as r:
            text = await r.text()
        assert re.search(r'kvoffload_proxy_backend_retries_total\{backend="[^"]+",role="prefiller"\} 2\.0', text)
        await _until(lambda: s.decoders[0].metaserver_answers)
        assert s.decoders[0].metaserver_answers[0][0] == 503
        await _assert_idle(s)


async def test_retry_moves_to_a_live_decoder(stack):
    async with stack(decoders=("ok",), down_decoders=1) as s:
        for _ in range(3):
            status, data, _ = await s.post("/v1/completions", {"prompt": "hi"})
            assert status == 200, data
        assert len(s.decoders[0].received) == 3
        await _assert_idle(s)


async def test_decoder_that_never_registers_times_out(stack):
    async with stack(decoders=("no_register",), args=["--metaserver-timeout-s", "0.5"]) as s:
        t0 = time.monotonic()
        status, data, _ = await s.post("/v1/completions", {"prompt": "hi"})
        assert status == 504 and "did not register" in data["error"]["message"]
        assert time.monotonic() - t0 < 3
        assert await _until(lambda: s.decoders[0].cancelled == 1)  # the proxy dropped the decoder request
        await _assert_idle(s)


async def test_midstream_decoder_failure_becomes_sse_error_then_done(stack):
    async with stack(decoders=("die_midstream",)) as s:
        status, events = await s.stream("/v1/completions", {"prompt": "hi", "stream": True})
        assert status == 200
        assert events[0]["choices"][0]["text"] == "<hi>"
        assert "error" in events[-2] and events[-2]["error"]["code"] == 502
        assert events[-1] == "[DONE]"
        await _assert_idle(s)


async def test_client_disconnect_cancels_decoder_request(stack):
    async with stack(decoders=("slow",)) as s:
        async with s.http.post(s.url + "/v1/completions",
                               json={"prompt": "hi", "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()  # first event arrived: the decoder is mid-stream
            r.close()  # the client goes away
        assert await _until(lambda: s.decoders[0].cancelled == 1)
        await _assert_idle(s)

    async with stack(decoders=("hang",)) as s:  # gone while waiting, before any output
        try:
            await s.http.post(s.url + "/v1/completions", json={"prompt": "hi"},
                              timeout=aiohttp.ClientTimeout(total=0.3))
        except asyncio.TimeoutError:
            pass
        assert await _until(lambda: s.decoders[0].cancelled == 1)
        await _assert_idle(s)


async def test_a_request_cancelled_again_while_it_cleans_up_is_still_accounted(stack):
    """The client leaving cancels the handler; a drain (or aiohttp, once the connection is gone)
    may cancel it again while its `finally:` waits for the decoder tasks: the request still
    leaves the in-flight set and releases its leases (a drain would otherwise wait its whole
    grace for a request that ended long ago)."""
    async with stack(decoders=("slow",)) as s:
        flow = s.app[FLOW]
        async with s.http.post(s.url + "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()  # mid-stream
            [task] = list(flow._inflight)
            cancels = 0
            while not task.done():  # a cancel on every turn of the loop, the cleanup's wait included
                task.cancel()
                cancels += 1
                await asyncio.sleep(0)
        assert cancels >= 2
        await _assert_idle(s)


async def test_a_request_answered_before_its_prefill_lets_the_prefill_finish(stack):
    """A decoder that answers before the prefiller has (a vLLM decode needs only the pulled
    layers): the client gets its answer at once, the prefill is not cancelled (its server would count
    an aborted request) but answered, the waiting registration gets that answer, and afterwards
    nothing is held."""
    async with stack(decoders=("no_wait",), prefill_delay_s=0.8) as s:
        t0 = time.monotonic()
        status, data, _ = await s.post("/v1/completions", {"prompt": "hi"})
        assert status == 200 and data["choices"][0]["text"] == "<hi> a b"
        assert time.monotonic() - t0 < 0.7  # not held for the prefill
        assert s.prefillers[0].done_at == []
        assert await _until(lambda: s.decoders[0].metaserver_answers, 3.0)
        assert s.prefillers[0].cancelled == 0 and len(s.prefillers[0].done_at) == 1
        assert s.decoders[0].metaserver_answers[0][0] == 200
        await _assert_idle(s)

    async with stack(decoders=("no_wait",), prefillers=("hang",)) as s:  # shutdown: cancelled then
        status, _, _ = await s.post("/v1/completions", {"prompt": "hi"})
        assert status == 200 and s.prefillers[0].cancelled == 0
        await s.app[FLOW].registry.aclose()
        assert await _until(lambda: s.prefillers[0].cancelled == 1)
        assert await _until(lambda: s.decoders[0].metaserver_answers)
        assert s.decoders[0].metaserver_answers[0][0] == 410
        await _assert_idle(s)


async def test_client_disconnect_cancels_pending_prefill(stack):
    async with stack(prefillers=("hang",)) as s:
        try:
            await s.http.post(s.url + "/v1/completions", json={"prompt": "hi"},
                              timeout=aiohttp.ClientTimeout(total=0.5))
        except asyncio.TimeoutError:
            pass
        await _until(lambda: s.prefillers[0].cancelled and s.decoders[0].metaserver_answers)
        assert s.prefillers[0].cancelled == 1
        assert s.decoders[0].metaserver_answers[0][0] == 410  # never "ok"
        await _assert_idle(s)


async def test_api_key_enforced(stack):
    async with stack(args=["--api-key", "sekret"]) as s:
        body = {"prompt": "hi"}
        assert (await s.post("/v1/completions", body))[0] == 401
        bad = {"Authorization": "Bearer nope"}
        status, data, _ = await s.post("/v1/completions", body, headers=bad)
        assert status == 401 and data["error"]["type"] == "authentication_error"
        good = {"Authorization": "Bearer sekret"}
        assert (await s.post("/v1/completions", body, headers=good))[0] == 200
        async with s.http.get(s.url + "/healthcheck") as r:
            assert r.status == 200
        async with s.http.get(s.url + "/metrics") as r:
            assert r.status == 401
        assert s.decoders[0].metaserver_answers[0][0] == 200  # decoders need no key


async def test_bad_input_is_4xx_naming_the_field(stack):
    async with stack(args=["--max-request-bytes", "2048"]) as s:
        cases = [
            (b"{not json", 400, "not valid JSON"),
            (b"[1, 2]", 400, "must be a JSON object"),
            (b'{"prompt": 5}', 400, "'prompt'"),
            (b'{"prompt": []}', 400, "'prompt'"),
            (b'{"prompt": "x", "stream": "yes"}', 400, "'stream'"),
            (b'{"prompt": "x", "max_tokens": 0}', 400, "'max_tokens'"),
            (b'{"prompt": "x", "max_tokens": NaN}', 400, "not valid JSON"),
            (b'{"max_tokens": 3}', 400, "'prompt' is required"),
            (b'{"prompt": "' + b"x" * 4096 + b'"}', 413, "--max-request-bytes"),
        ]
        for raw, want, fragment in cases:
            async with s.http.post(s.url + "/v1/completions", data=raw,
                                   headers={"Content-Type": "application/json"}) as r:
                data = await r.json()
                assert r.status == want, (raw[:40], data)
                assert fragment in data["error"]["message"], data
        status, data, _ = await s.post("/v1/chat/completions", {"messages": [{"content": "x"}]})
        assert status == 400 and "'messages[0].role'" in data["error"]["message"]
        status, data, _ = await s.post("/v1/completions", {"prompt": "x"},
                                       headers={"X-Request-Id": "has space"})
        assert status == 400 and "X-Request-Id" in data["error"]["message"]
        async with s.http.get(s.url + "/v1/completions") as r:
            assert r.status == 405 and "error" in await r.json()
        async with s.http.get(s.url + "/nope") as r:
            assert r.status == 404
        assert s.decoders[0].received == []


async def test_metaserver_rejects_unknown_and_malformed(stack):
    async with stack() as s:
        status, data, _ = await s.post("/v1/metaserver", {"request_id": "cmpl-nope",
                                                          "kv_transfer_params": {}})
        assert status == 404 and "cmpl-nope" in data["error"]["message"]
        status, data, _ = await s.post("/v1/metaserver", {"kv_transfer_params": {}})
        assert status == 400 and "'request_id'" in data["error"]["message"]
        status, data, _ = await s.post("/v1/metaserver", {"request_id": 3})
        assert status == 400


async def test_metrics_and_openapi(stack):
    async with stack() as s:
        assert (await s.post("/v1/completions", {"prompt": "hi"}))[0] == 200
        assert (await s.post("/v1/completions", {"prompt": 1}))[0] == 400
        async with s.http.get(s.url + "/metrics") as r:
            text = await r.text()
        assert 'kvoffload_proxy_requests_total{endpoint="completions",outcome="ok"} 1.0' in text
        assert 'outcome="client_error"} 1.0' in text
        assert "kvoffload_proxy_backend_active_tokens{" in text
        assert 'kvoffload_proxy_metaserver_latency_seconds_count{outcome="ok"} 1.0' in text
        async with s.http.get(s.url + "/openapi.json") as r:
            doc = await r.json()
        assert doc["openapi"].startswith("3.1")
        routes = {(r.method.lower(), r.resource.canonical) for r in s.app.router.routes()}
        for path, ops in doc["paths"].items():
            for method in ops:
                assert (method, path) in routes
        assert "CompletionRequest" in doc["components"]["schemas"]
