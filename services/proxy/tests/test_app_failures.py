"""End to end through the real proxy app: a backend that fails, is unreachable or never registers,
and a client that leaves; each becomes the right status (or SSE error) and nothing stays held."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp

from kvoffload_proxy.app import FLOW


async def test_decoder_500_becomes_502(stack):
    async with stack(decoders=("http500",)) as s:
        for stream in (False, True):
            status, data, _ = await s.post("/v1/completions", {"prompt": "hi", "stream": stream})
            assert status == 502, data
            assert s.decoders[0].url in data["error"]["message"]
            assert data["error"]["decoder"] == s.decoders[0].url
        assert s.prefillers[0].received == []
        await s.assert_idle()


async def test_decoder_400_is_relayed(stack):
    async with stack(decoders=("reject400",)) as s:
        status, data, _ = await s.post("/v1/completions", {"prompt": "very long"})
        assert status == 400
        assert data["error"]["message"] == "prompt is longer than max_model_len"
        await s.assert_idle()


async def test_prefiller_failure_fails_metaserver_and_client_fast(stack):
    async with stack(prefillers=("http500",)) as s:
        t0 = time.monotonic()
        status, data, _ = await s.post("/v1/completions", {"prompt": "hi", "stream": True})
        assert time.monotonic() - t0 < 3
        assert status == 502, data
        assert data["error"]["prefiller"] == s.prefillers[0].url
        assert "HTTP 500" in data["error"]["message"]
        await s.until(lambda: s.decoders[0].metaserver_answers)
        ms_status, ms_body, _ = s.decoders[0].metaserver_answers[0]
        assert ms_status == 502 and ms_body["status"] == "error"
        assert ms_body["prefiller"] == s.prefillers[0].url
        assert "prefill exploded" in ms_body["error"]["message"]
        await s.assert_idle()


async def test_unreachable_prefiller_is_retried_then_503(stack):
    async with stack(prefillers=(), down_prefillers=1, args=["--max-retries", "2"]) as s:
        status, data, _ = await s.post("/v1/completions", {"prompt": "hi"})
        assert status == 503, data
        assert "after 3 attempt(s)" in data["error"]["message"]
        async with s.http.get(s.url + "/metrics") as r:
            text = await r.text()
        assert re.search(r'kvoffload_proxy_backend_retries_total\{backend="[^"]+",role="prefiller"\} 2\.0', text)
        await s.until(lambda: s.decoders[0].metaserver_answers)
        assert s.decoders[0].metaserver_answers[0][0] == 503
        await s.assert_idle()


async def test_retry_moves_to_a_live_decoder(stack):
    async with stack(decoders=("ok",), down_decoders=1) as s:
        for _ in range(3):
            status, data, _ = await s.post("/v1/completions", {"prompt": "hi"})
            assert status == 200, data
        assert len(s.decoders[0].received) == 3
        await s.assert_idle()


async def test_decoder_that_never_registers_times_out(stack):
    async with stack(decoders=("no_register",), args=["--metaserver-timeout-s", "0.5"]) as s:
        t0 = time.monotonic()
        status, data, _ = await s.post("/v1/completions", {"prompt": "hi"})
        assert status == 504 and "did not register" in data["error"]["message"]
        assert time.monotonic() - t0 < 3
        assert await s.until(lambda: s.decoders[0].cancelled == 1)  # the proxy dropped the decoder request
        await s.assert_idle()


async def test_midstream_decoder_failure_becomes_sse_error_then_done(stack):
    async with stack(decoders=("die_midstream",)) as s:
        status, events = await s.stream("/v1/completions", {"prompt": "hi", "stream": True})
        assert status == 200
        assert events[0]["choices"][0]["text"] == "<hi>"
        assert "error" in events[-2] and events[-2]["error"]["code"] == 502
        assert events[-1] == "[DONE]"
        await s.assert_idle()


async def test_client_disconnect_cancels_decoder_request(stack):
    async with stack(decoders=("slow",)) as s:
        async with s.http.post(s.url + "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()  # first event arrived: the decoder is mid-stream
            r.close()  # the client goes away
        assert await s.until(lambda: s.decoders[0].cancelled == 1)
        await s.assert_idle()

    async with stack(decoders=("hang",)) as s:  # gone while waiting, before any output
        try:
            await s.http.post(
                s.url + "/v1/completions", json={"prompt": "hi"}, timeout=aiohttp.ClientTimeout(total=0.3)
            )
        except asyncio.TimeoutError:
            pass
        assert await s.until(lambda: s.decoders[0].cancelled == 1)
        await s.assert_idle()


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
        await s.assert_idle()


async def test_a_request_answered_before_its_prefill_lets_the_prefill_finish(stack):
    """A decoder that answers before the prefiller has (a vLLM decode needs only the pulled
    layers): the client gets its answer at once, the prefill is not cancelled (its server would count
    an aborted request) but answered, the waiting registration gets that answer, and afterwards
    nothing is held."""
    async with stack(decoders=("no_wait",), prefill_delay_s=1.5) as s:
        status, data, _ = await s.post("/v1/completions", {"prompt": "hi"})
        assert status == 200 and data["choices"][0]["text"] == "<hi> a b"
        assert s.prefillers[0].done_at == []  # answered before the prefill was: not held for it
        assert await s.until(lambda: s.decoders[0].metaserver_answers, 5.0)
        assert s.prefillers[0].cancelled == 0 and len(s.prefillers[0].done_at) == 1
        assert s.decoders[0].metaserver_answers[0][0] == 200
        await s.assert_idle()

    async with stack(decoders=("no_wait",), prefillers=("hang",)) as s:  # shutdown: cancelled then
        status, _, _ = await s.post("/v1/completions", {"prompt": "hi"})
        assert status == 200 and s.prefillers[0].cancelled == 0
        await s.app[FLOW].registry.aclose()
        assert await s.until(lambda: s.prefillers[0].cancelled == 1)
        assert await s.until(lambda: s.decoders[0].metaserver_answers)
        assert s.decoders[0].metaserver_answers[0][0] == 410
        await s.assert_idle()


async def test_client_disconnect_cancels_pending_prefill(stack):
    async with stack(prefillers=("hang",)) as s:
        try:
            await s.http.post(
                s.url + "/v1/completions", json={"prompt": "hi"}, timeout=aiohttp.ClientTimeout(total=0.5)
            )
        except asyncio.TimeoutError:
            pass
        await s.until(lambda: s.prefillers[0].cancelled and s.decoders[0].metaserver_answers)
        assert s.prefillers[0].cancelled == 1
        assert s.decoders[0].metaserver_answers[0][0] == 410  # never "ok"
        await s.assert_idle()
