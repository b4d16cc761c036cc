"""The real proxy app's other routes: /healthcheck, /reset_prefix_cache, /metrics and /openapi.json,
and the API key in front of them."""

from __future__ import annotations


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
