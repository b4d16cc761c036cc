"""The proxy's API key (--api-key / $KVOFFLOAD_API_KEY): clients need `Authorization: Bearer KEY`
everywhere but /healthcheck and /openapi.json; decoders authenticate /v1/metaserver with the
per-request token the proxy handed them, never with the key."""

from __future__ import annotations

import asyncio
import hmac
import time

import pytest

from kvoffload_proxy import auth
from kvoffload_proxy.app import FLOW
from kvoffload_proxy.config import API_KEY_ENV, parse_args

KEY = "sekret-key"
GOOD = {"Authorization": f"Bearer {KEY}"}
BASE = [
    "--prefiller-hosts",
    "127.0.0.1",
    "--prefiller-ports",
    "8100",
    "--decoder-hosts",
    "127.0.0.1",
    "--decoder-ports",
    "8200",
]


async def _until(cond, timeout_s=3.0):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return cond()


def test_key_from_flag_or_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert parse_args(BASE).api_key is None  # default: no key, everything open (loopback bind)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse_args(BASE).api_key == "from-env"
    assert parse_args([*BASE, "--api-key", "from-flag"]).api_key == "from-flag"


async def test_clients_need_the_key(stack):
    async with stack(args=["--api-key", KEY]) as s:
        body = {"prompt": "hi"}
        for headers in (
            {},
            {"Authorization": "Bearer nope"},
            {"Authorization": f"Basic {KEY}"},
            {"Authorization": KEY},
            {"Authorization": f"Bearer {KEY}x"},
        ):
            for path in ("/v1/completions", "/v1/chat/completions"):
                status, data, r = await s.post(path, body, headers=headers)
                assert status == 401, (path, headers)
                assert data["error"]["type"] == "authentication_error" and data["error"]["code"] == 401
                assert "Authorization: Bearer KEY" in data["error"]["message"]
                assert r.headers["WWW-Authenticate"].startswith("Bearer")
                assert KEY not in str(data)
        assert not s.decoders[0].received and not s.prefillers[0].received  # nothing reached a backend
        status, data, _ = await s.post("/v1/completions", body, headers=GOOD)
        assert status == 200 and data["choices"][0]["text"] == "<hi> a b"
        status, _, _ = await s.post("/v1/completions", body, headers={"Authorization": f"bearer  {KEY}"})
        assert status == 200  # the scheme is case-insensitive
        for method, path in (("GET", "/metrics"), ("POST", "/reset_prefix_cache"), ("GET", "/v1/models")):
            async with s.http.request(method, s.url + path) as r:
                assert r.status == 401, path
            async with s.http.request(method, s.url + path, headers=GOOD) as r:
                assert r.status == 200, path


async def test_compared_in_constant_time(stack, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    async with stack(args=["--api-key", KEY]) as s:
        assert (await s.post("/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer guess"}))[0] == 401
    assert (b"guess", KEY.encode()) in calls


async def test_open_routes(stack):
    async with stack(args=["--api-key", KEY]) as s:
        async with s.http.get(s.url + "/healthcheck") as r:  # load balancers hold no key ...
            assert r.status == 200 and await r.json() == {"status": "ok"}  # ... and learn no topology
        async with s.http.get(s.url + "/healthcheck", headers=GOOD) as r:
            data = await r.json()
            assert r.status == 200 and len(data["backends"]) == 2
        async with s.http.get(s.url + "/openapi.json") as r:
            doc = await r.json()
    assert r.status == 200
    schemes = doc["components"]["securitySchemes"]
    assert schemes["bearer"] == {"type": "http", "scheme": "bearer", "description": schemes["bearer"]["description"]}
    assert schemes["metaserverToken"]["scheme"] == "bearer"
    paths = doc["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/reset_prefix_cache"):
        assert paths[path]["post"]["security"] == [{"bearer": []}] and "401" in paths[path]["post"]["responses"]
    for path in ("/metrics", "/v1/models"):
        assert paths[path]["get"]["security"] == [{"bearer": []}] and "401" in paths[path]["get"]["responses"]
    assert paths["/v1/metaserver"]["post"]["security"] == [{"metaserverToken": []}]
    assert "security" not in paths["/healthcheck"]["get"]


async def test_without_key_no_auth_and_no_token(stack):
    async with stack() as s:
        assert (await s.post("/v1/completions", {"prompt": "hi"}))[0] == 200
        assert "metaserver_token" not in s.decoders[0].received[0]["kv_transfer_params"]
        assert s.decoders[0].metaserver_answers[0][0] == 200
        async with s.http.get(s.url + "/healthcheck") as r:
            assert "backends" in await r.json()
        async with s.http.get(s.url + "/openapi.json") as r:
            assert "securitySchemes" not in (await r.json())["components"]


async def test_decoders_register_with_their_request_token_only(stack):
    """The decoder gets a token bound to its request id (not the key); the metaserver accepts that
    token for that id and nothing else: no header, the client key, another id's token."""
    async with stack(args=["--api-key", KEY], decoders=("no_register",)) as s:
        client = asyncio.ensure_future(s.post("/v1/completions", {"prompt": "hi"}, headers=GOOD))
        try:
            assert await _until(lambda: s.decoders[0].received)
            ktp = s.decoders[0].received[0]["kv_transfer_params"]
            rid, token = ktp["request_id"], ktp["metaserver_token"]
            assert KEY not in str(s.decoders[0].received[0]) and KEY not in str(s.decoders[0].headers[0])
            registration = {"request_id": rid, "kv_transfer_params": s.decoders[0].endpoint_params(rid)}
            url = s.url + "/v1/metaserver"
            altered = token[:-1] + ("1" if token[-1] == "0" else "0")
            forged = [
                {},
                GOOD,
                {"Authorization": f"Bearer {s.app[FLOW].tokens.issue(rid + '-0')}"},
                {"Authorization": f"Bearer {altered}"},
            ]
            for headers in forged:
                async with s.http.post(url, json=registration, headers=headers) as r:
                    data = await r.json()
                    assert r.status == 401, headers
                    assert data["error"]["type"] == "authentication_error"
            assert not s.prefillers[0].received  # no forged registration dispatched a prefill
            async with s.http.post(url, json=registration, headers={"Authorization": f"Bearer {token}"}) as r:
                assert r.status == 200 and await r.json() == {"status": "ok"}
            assert s.prefillers[0].received[0]["kv_transfer_params"] == registration["kv_transfer_params"]
        finally:
            client.cancel()
            await asyncio.gather(client, return_exceptions=True)


async def test_fake_decoder_round_trip_with_key(stack):
    """The full decode-first flow with a key: the decoder echoes its token and the request succeeds."""
    async with stack(args=["--api-key", KEY], decoders=("ok", "ok")) as s:
        for i in range(2):
            status, data, _ = await s.post("/v1/completions", {"prompt": f"p{i}", "stream": False}, headers=GOOD)
            assert status == 200
        answers = [a for d in s.decoders for a in d.metaserver_answers]
        assert [a[0] for a in answers] == [200, 200]
        tokens = {
            d.received[j]["kv_transfer_params"]["metaserver_token"] for d in s.decoders for j in range(len(d.received))
        }
        assert len(tokens) == 2  # one per request


def test_tokens_are_per_request_and_per_proxy():
    a, b = auth.MetaserverTokens(True), auth.MetaserverTokens(True)
    ta = a.issue("cmpl-1")
    assert a.check(ta, "cmpl-1") and not a.check(ta, "cmpl-2") and not a.check(None, "cmpl-1")
    assert not b.check(ta, "cmpl-1")  # another proxy (another start-up secret) does not accept it
    off = auth.MetaserverTokens(False)
    assert off.issue("cmpl-1") is None and off.check(None, "cmpl-1")


@pytest.mark.parametrize(
    "header, token",
    [
        ("Bearer abc", "abc"),
        ("bearer   abc ", "abc"),
        ("Basic abc", None),
        ("Bearer", None),
        ("", None),
        ("Bearer ", None),
    ],
)
def test_bearer_parsing(header, token):
    assert auth.bearer({"Authorization": header} if header else {}) == token
