"""The decode's HTTP admission (issue 11): a request the host pool cannot hold yet is queued, tells
the metaserver so (the proxy's registration deadline no longer applies to it) and registers for
real once it got its blocks; past the queue limit a request gets 429 with Retry-After at once;
every answer carries ``X-Decode-Load``."""

import asyncio
from functools import partial

import aiohttp
from aiohttp import web

from dsamodel.presets import tiny_model
from dsamodel.tokenizer import ByteTokenizer
from kvoffload_decode.app import AppSettings, build_app
from kvoffload_decode.loop import DecodeLoop
from kvoffload_engine import build
from kvoffload_engine.decode import SparseDecoder

N = 40


class _Transfer:
    counters = {"read_done": 0, "read_ms_total": 0.0}


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


class _Metaserver:
    """The proxy's ``/v1/metaserver``: records every call; a queued notice is answered at once, a
    registration when the test sets its status in ``answers`` ("the prefill")."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.answers: dict[str, asyncio.Future] = {}

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(body)
        if body["kv_transfer_params"].get("queued"):
            return web.json_response({"status": "ok"})
        fut = self.answers.setdefault(body["request_id"], asyncio.get_running_loop().create_future())
        status = await fut  # held until the test answers
        return web.json_response({"status": "error"}, status=status)

    async def until(self, cond, what: str) -> None:
        for _ in range(200):
            if cond():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}: {self.calls}")


def _body(rid: str, metaserver: str) -> dict:
    """A completion of an N-token prompt whose KV a remote prefill pushes (its ``metaserver``)."""
    return {
        "prompt": list(range(1, N + 1)),
        "max_tokens": 2,
        "kv_transfer_params": {"do_remote_prefill": True, "metaserver": metaserver, "request_id": rid},
    }


async def _scenario(loop: DecodeLoop) -> None:
    meta = _Metaserver()
    calls, answers, until = meta.calls, meta.answers, meta.until
    meta_app = web.Application()
    meta_app.router.add_post("/v1/metaserver", meta.handle)
    meta_runner, meta_url = await _serve(meta_app)
    settings = AppSettings(model_name="tiny", max_model_len=256, advertise_host="127.0.0.1", control_port=1, dp_rank=1)
    dec_runner, dec_url = await _serve(build_app(loop, _Transfer(), ByteTokenizer(), settings))
    body = partial(_body, metaserver=f"{meta_url}/v1/metaserver")

    try:
        async with aiohttp.ClientSession() as http:
            a = asyncio.ensure_future(http.post(f"{dec_url}/v1/completions", json=body("A")))
            await until(lambda: "A" in answers, "A's registration")
            assert calls[0] == {
                "request_id": "A",
                "kv_transfer_params": {  # its true DP rank (--dp-rank 1)
                    "request_id": "A",
                    "remote_host": "127.0.0.1",
                    "remote_port": 1,
                    "remote_tp_size": 1,
                    "remote_dp_rank": 1,
                },
            }
            b = asyncio.ensure_future(http.post(f"{dec_url}/v1/completions", json=body("B")))
            await until(lambda: any(c["request_id"] == "B" for c in calls), "B's queued notice")
            assert calls[-1] == {"request_id": "B", "kv_transfer_params": {"request_id": "B", "queued": True}}
            assert loop.stats()["waiting_for_blocks"] == 1 and loop.ledger.stage_of("B") == "queued"

            loop.max_queued = 2  # A and B queued: one more is refused at once
            async with http.post(f"{dec_url}/v1/completions", json=body("C")) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
                assert "queued=2" in r.headers["X-Decode-Load"] and "free_pool_bytes=" in r.headers["X-Decode-Load"]
                err = (await r.json())["error"]
                assert err["code"] == 429 and err["type"] == "rate_limit_error"

            answers["A"].set_result(502)  # A's prefill failed: A ends and frees its blocks ...
            async with await a as r:
                assert r.status == 502
            await until(lambda: "B" in answers, "B's registration once it got A's blocks")  # ... B gets them
            assert [c["kv_transfer_params"].get("queued", False) for c in calls if c["request_id"] == "B"] == [
                True,
                False,
            ]
            answers["B"].set_result(502)
            async with await b as r:
                assert r.status == 502
        await until(lambda: loop.stats()["sequences"] == 0, "everything freed")
        assert loop.decoder.pool.stats().used_bytes == 0 and loop.stats()["queued"] == 0
    finally:
        await dec_runner.cleanup()
        await meta_runner.cleanup()


def _run(scenario, **loop_kw) -> None:
    """``scenario(loop)`` against a decode whose host pool holds one request of N + 1 tokens (3 blocks)."""
    model = tiny_model(dtype="float32")
    block_bytes = build.decode_geometry(model, 16, 1 << 20).block_bytes
    pool = build.decode_pool(model, 16, block_bytes * 4)
    decoder = SparseDecoder(model, pool, topk_buffer_size=64, max_num_seqs=2, max_model_len=256)
    loop = DecodeLoop(decoder, model.config.eos_token_id, **loop_kw)
    try:
        asyncio.run(asyncio.wait_for(scenario(loop), 60))
    finally:
        loop.close()
        pool.close()


def test_a_queued_request_registers_once_it_has_blocks_and_the_queue_limit_is_429():
    _run(_scenario)


async def _queue_timeout_scenario(loop: DecodeLoop) -> None:
    """A holds the pool's blocks (its registration held: its prefill "runs"); B, streamed, waits for
    blocks past the 1 s bound: it gets 429 with Retry-After and the OpenAI error body, no SSE byte,
    and nothing of it stays held."""
    meta = _Metaserver()
    meta_app = web.Application()
    meta_app.router.add_post("/v1/metaserver", meta.handle)
    meta_runner, meta_url = await _serve(meta_app)
    settings = AppSettings(model_name="tiny", max_model_len=256, advertise_host="127.0.0.1", control_port=1)
    dec_runner, dec_url = await _serve(build_app(loop, _Transfer(), ByteTokenizer(), settings))
    body = partial(_body, metaserver=f"{meta_url}/v1/metaserver")
    try:
        async with aiohttp.ClientSession() as http:
            a = asyncio.ensure_future(http.post(f"{dec_url}/v1/completions", json=body("A")))
            await meta.until(lambda: "A" in meta.answers, "A's registration")
            began = asyncio.get_running_loop().time()
            async with http.post(f"{dec_url}/v1/completions", json={**body("B"), "stream": True}) as r:
                waited = asyncio.get_running_loop().time() - began
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1, await r.text()
                assert r.headers["Content-Type"].startswith("application/json")  # not an event stream
                err = (await r.json())["error"]
                assert err["type"] == "rate_limit_error" and "--max-queue-wait-s=1" in err["message"], err
            assert 0.5 < waited < 5, waited
            st = loop.stats()
            assert (st["queue_timeouts"], st["queued"], st["waiting_for_blocks"]) == (1, 1, 0), st
            meta.answers["A"].set_result(502)
            async with await a as r:
                assert r.status == 502
        await meta.until(lambda: loop.stats()["sequences"] == 0, "everything freed")
        assert loop.decoder.pool.stats().used_bytes == 0 and loop.stats()["ledger_open"] == 0
    finally:
        await dec_runner.cleanup()
        await meta_runner.cleanup()


def test_a_request_queued_past_the_bound_gets_429_before_any_byte():
    _run(_queue_timeout_scenario, max_queue_wait_s=1.0)
