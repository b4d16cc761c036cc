"""A backend's ``Retry-After`` reaches the client: the prefiller's (its queue would hold the request
past its bound), and, every decoder refusing, the smallest of theirs — the wait each computed from
its queue, never a constant of the proxy's."""

import pytest
from aiohttp import web


def _refusing(backend, retry_after: str, message: str) -> None:
    async def generate(request, body):
        return web.json_response(
            {"error": {"message": message, "type": "rate_limit_error", "param": None, "code": 429}},
            status=429,
            headers={"Retry-After": retry_after},
        )

    backend.generate = generate


@pytest.mark.parametrize("stream", [False, True])
async def test_the_prefillers_retry_after_reaches_the_client(stack, stream):
    st = stack()
    said = "the prefill would start this request in about 93.0 s, past its bound --max-queue-wait-s=60"
    _refusing(st.prefillers[0], "37", said)
    async with st as s:
        body = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": stream}
        status, data, r = await s.post("/v1/completions", body)
        assert status == 429 and r.headers["Retry-After"] == "37", (status, dict(r.headers), data)
        err = data["error"]
        assert err["code"] == 429 and err["type"] == "rate_limit_error", err
        assert "retry after 37 s" in err["message"] and said in err["message"], err
        assert len(s.prefillers[0].received) == 1


async def test_every_decoder_full_gives_the_smallest_of_their_long_hints(stack):
    st = stack(decoders=("ok", "ok", "ok"))
    for decoder, wait in zip(st.decoders, ("45", "38", "52"), strict=True):
        _refusing(decoder, wait, f"the decode would start this request in about {60 + int(wait)} s")
    async with st as s:
        for _ in range(2):  # then again, every decoder known to be full: each asked, its hint kept
            status, data, r = await s.post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3})
            assert status == 429 and r.headers["Retry-After"] == "38", (status, dict(r.headers), data)
            assert "retry after 38 s" in data["error"]["message"], data
        assert [len(d.received) for d in s.decoders] == [2, 2, 2]
        assert not s.prefillers[0].received
