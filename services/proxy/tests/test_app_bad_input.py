"""The real proxy app given bad input: malformed or oversized bodies, wrong field types, a bad
X-Request-Id, unknown routes and registrations; always a 4xx naming what is wrong, never a 5xx."""

from __future__ import annotations

import time


async def test_random_bodies_never_5xx(stack):
    """A seeded mini-fuzz: whatever JSON arrives, the answer is 2xx or 4xx, quickly."""
    import random

    rng = random.Random(1234)
    atoms = [None, True, 0, -1, 1.5, 2**40, "", "x", [], {}, [1, "a"], [[1], []], {"a": 1}]
    keys = [
        "prompt",
        "messages",
        "stream",
        "max_tokens",
        "n",
        "stream_options",
        "model",
        "request_id",
        "kv_transfer_params",
        "role",
        "content",
        "max_completion_tokens",
    ]

    def value(depth=0):
        r = rng.random()
        if depth < 2 and r < 0.2:
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        if depth < 2 and r < 0.35:
            return {rng.choice(keys): value(depth + 1) for _ in range(rng.randrange(3))}
        return rng.choice(atoms)

    async with stack(args=["--metaserver-timeout-s", "1"]) as s:
        for _ in range(150):
            path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/metaserver"])
            body = {rng.choice(keys): value() for _ in range(rng.randrange(4))}
            t0 = time.monotonic()
            status, data, _ = await s.post(path, body)
            assert status < 500 and time.monotonic() - t0 < 3, (path, body, status, data)
        await s.assert_idle()


async def test_bad_input_is_4xx_naming_the_field(stack):
    async with stack(args=["--max-request-bytes", "2048"]) as s:
        cases = [
            (b"{not json", 400, "not valid JSON"),
            (b"[1, 2]", 400, "must be a JSON object"),
            (b'{"prompt": 5}', 400, "prompt: must be"),
            (b'{"prompt": []}', 400, "prompt: must be"),
            (b'{"prompt": "x", "stream": "yes"}', 400, "stream: must be a boolean, got 'yes'"),
            (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens: must be an integer >= 1"),
            (b'{"prompt": "x", "max_tokens": NaN}', 400, "not valid JSON"),
            (b'{"max_tokens": 3}', 400, "prompt: required"),
            (b'{"prompt": "' + b"x" * 4096 + b'"}', 413, "--max-request-bytes"),
        ]
        for raw, want, fragment in cases:
            async with s.http.post(
                s.url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
            ) as r:
                data = await r.json()
                assert r.status == want, (raw[:40], data)
                assert fragment in data["error"]["message"], data
        status, data, _ = await s.post("/v1/chat/completions", {"messages": [{"content": "x"}]})
        assert status == 400 and "messages[0].role: required" in data["error"]["message"]
        status, data, _ = await s.post("/v1/completions", {"prompt": "x"}, headers={"X-Request-Id": "has space"})
        assert status == 400 and "X-Request-Id" in data["error"]["message"]
        async with s.http.get(s.url + "/v1/completions") as r:
            assert r.status == 405 and "error" in await r.json()
        async with s.http.get(s.url + "/nope") as r:
            assert r.status == 404
        assert s.decoders[0].received == []


async def test_metaserver_rejects_unknown_and_malformed(stack):
    async with stack() as s:
        status, data, _ = await s.post("/v1/metaserver", {"request_id": "cmpl-nope", "kv_transfer_params": {}})
        assert status == 404 and "cmpl-nope" in data["error"]["message"]
        status, data, _ = await s.post("/v1/metaserver", {"kv_transfer_params": {}})
        assert status == 400 and "request_id: required" in data["error"]["message"]
        status, data, _ = await s.post("/v1/metaserver", {"request_id": 3})
        assert status == 400
        status, data, _ = await s.post(
            "/v1/metaserver", {"request_id": "cmpl-nope", "kv_transfer_params": {"remote_port": "80"}}
        )
        assert (
            status == 400
            and "kv_transfer_params.remote_port: Input should be a valid integer, got '80'" in data["error"]["message"]
        )
        status, data, _ = await s.post("/v1/metaserver", {"request_id": "cmpl-nope", "queued": "yes"})
        assert status == 400 and "queued: Input should be a valid boolean, got 'yes'" in data["error"]["message"]
