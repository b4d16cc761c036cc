"""``kvoffload bench load`` judges the burst whole and the polite burst by its retries: a burst where
every request got a 5xx meets no goal of the burst's; a polite burst meets its goals with at most 3
retries a request, every request answered and none failed. The polite clients and the load clients
wait a 429's ``Retry-After`` as OpenAI's Python client does, counted against a server that refuses
each request twice. A client count's level counts the answers unequal to the engine's and names
them."""

from __future__ import annotations

import http.server
import json
import random
import threading
from collections import Counter

import pytest

from kvoffload_bench import load, load_polite, load_report
from kvoffload_bench.load_polite import GOAL_RETRIES_PER_REQUEST, MAX_RETRIES, retry_delay_s

LEVEL = {"ok": 64, "failed": 0, "rejected_429": 0, "throughput_ratio": 0.95, "tokens_equal": True}
SIZES = {"clients": [64], "rounds": 1}


def _burst(ok: int, failed: int, timed_out: int = 0) -> dict:
    return {"requests": ok + failed + timed_out, "ok": ok, "failed": failed, "timed_out": timed_out, "rejected_429": 0}


def _polite(ok: int, failed: int, retries: int) -> dict:
    n = ok + failed
    return {"requests": n, "ok": ok, "failed": failed, "retries": retries, "retries_per_request": retries / n}


def test_a_burst_whose_every_request_got_a_5xx_meets_no_burst_goal():
    r = load_report.result([LEVEL], SIZES, _burst(ok=0, failed=96), _polite(96, 0, 0))
    met = r["goals_met"]
    assert met["burst_timed_out"] is True  # nothing waited without a byte: this alone met the goal before
    assert met["burst_ok"] is False and met["burst_failed"] is False
    assert r["goals"]["burst_ok"] == 1 and r["goals"]["burst_failed"] == 0
    one_failed = load_report.result([LEVEL], SIZES, _burst(ok=95, failed=1), _polite(96, 0, 0))["goals_met"]
    assert one_failed["burst_ok"] is True and one_failed["burst_failed"] is False
    assert load_report.result([LEVEL], SIZES, _burst(ok=50, failed=0), _polite(96, 0, 0))["goals_met"] == dict.fromkeys(
        r["goals"], True
    )


@pytest.mark.parametrize(
    ("polite", "met"),
    [
        (_polite(96, 0, 2937), {"retries": False, "answered": True, "failed": True}),  # the 31 tries a request
        (_polite(96, 0, 288), {"retries": True, "answered": True, "failed": True}),  # 3 a request: the goal
        (_polite(96, 0, 289), {"retries": False, "answered": True, "failed": True}),
        (_polite(91, 5, 100), {"retries": True, "answered": False, "failed": False}),
    ],
)
def test_the_polite_burst_is_judged_by_its_retries_its_answers_and_its_failures(polite, met):
    r = load_report.result([LEVEL], SIZES, _burst(ok=50, failed=0), polite)
    assert GOAL_RETRIES_PER_REQUEST == r["goals"]["burst_polite_retries_per_request"] == 3
    assert r["goals"]["burst_polite_all_answered"] is True and r["goals"]["burst_polite_failed"] == 0
    got = {k: r["goals_met"][f"burst_polite_{k}"] for k in ("retries_per_request", "all_answered", "failed")}
    assert got == {"retries_per_request": met["retries"], "all_answered": met["answered"], "failed": met["failed"]}
    assert r["burst_polite"] is polite and "not_measured" not in r


def test_a_polite_burst_of_no_request_is_not_measured_and_not_met():
    empty = {"requests": 0, "ok": 0, "failed": 0, "retries": 0, "retries_per_request": None}
    r = load_report.result([LEVEL], SIZES, _burst(ok=50, failed=0), empty)
    assert r["goals_met"]["burst_polite_retries_per_request"] is False
    assert r["goals_met"]["burst_polite_all_answered"] is False
    assert "burst_polite_retries_per_request" in r["not_measured"]


def test_the_pause_before_a_retry_is_openais_clients():
    rng = random.Random(0)
    assert retry_delay_s("37", 0, rng) == 37.0 and retry_delay_s("0.5", 3, rng) == 0.5  # followed as given
    assert retry_delay_s("121", 0, rng) is None  # past 120 s: openai does not retry
    for done, (lo, hi) in {0: (0.375, 0.5), 2: (1.5, 2.0), 10: (6.0, 8.0)}.items():  # no hint: backoff
        for hint in (None, "0", "soon"):
            delay = retry_delay_s(hint, done, rng)
            assert delay is not None and lo <= delay <= hi, (hint, done, delay)


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Refuses each prompt's first two tries (429, ``Retry-After: 1``), then answers: JSON, or a
    stream of one event with the prompt's first token."""

    tries: Counter = Counter()
    lock = threading.Lock()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = tuple(body["prompt"])
        with self.lock:
            self.tries[key] += 1
            tries = self.tries[key]
        if tries <= 2:
            self._send(429, b'{"error": {"code": 429}}', "application/json", {"Retry-After": "1"})
        elif body.get("stream"):
            event = {"choices": [{"index": 0, "token_ids": body["prompt"][:1]}]}
            self._send(200, f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream", {})
        else:
            self._send(200, b'{"choices": [{"index": 0, "token_ids": [1]}]}', "application/json", {})

    def _send(self, status: int, data: bytes, kind: str, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in {"Content-Type": kind, "Content-Length": str(len(data)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def refusing():
    _Refusing.tries = Counter()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    server.shutdown()
    server.server_close()


def test_polite_clients_wait_each_retry_after_and_count_their_retries(refusing):
    work = [([7, i], 2) for i in range(4)]
    out = load_polite.polite_burst(refusing, work, client_timeout_s=10)
    assert (out["requests"], out["streamed"], out["ok"], out["failed"], out["timed_out"]) == (4, 2, 4, 0, 0), out
    assert out["retries"] == out["rejected_429"] == 8 and out["retries_per_request"] == 2.0, out
    assert out["retry_after_s"] == [1.0] and out["not_followed"] == 0 and out["max_retries"] == MAX_RETRIES
    assert 2.0 <= out["answer_p50_s"] <= out["answer_max_s"] < 8, out  # two waits of 1 s each
    assert set(_Refusing.tries.values()) == {3}


def test_the_load_clients_follow_the_retry_after_too(refusing):
    start = threading.Event()
    start.set()
    rec = load._client(refusing, [9, 8, 7], 1, start, max_retries=5)
    assert rec["ok"] and rec["rejected"] == 2 and rec["ids"] == [9], rec
    assert rec["ttft"] is not None and rec["ttft"] < 2  # the last try's, not the waits'
    refused = load._client(refusing, [1, 2], 1, start, max_retries=1)  # its cap: 1 retry
    assert not refused["ok"] and refused["rejected"] == 2 and "HTTP 429" in refused["error"], refused


def test_a_level_counts_its_unequal_answers_and_names_them():
    rounds = [
        {"ok": 4, "throughput_ratio": 0.9, "tokens_equal": True, "tokens_unequal": 0, "unequal_examples": []},
        {"ok": 4, "throughput_ratio": 1.1, "tokens_equal": False, "tokens_unequal": 2, "unequal_examples": ["a", "b"]},
    ]
    lv = load_report.level(4, 2, rounds, {"max_queued": 32, "rejected": 0})
    assert (lv["ok"], lv["tokens_equal"], lv["tokens_unequal"], lv["unequal_examples"]) == (8, False, 2, ["a", "b"])
    assert lv["throughput_ratio"] == pytest.approx(1.0) and lv["per_round_throughput_ratio"] == [0.9, 1.1]
    example = load._unequal(([1] * 30, 8), [5, 6, 7, 9], [5, 6, 8, 9, 1, 2, 3, 4], 2)
    assert example == {
        "prompt_tokens": 30,
        "max_tokens": 8,
        "rejected_429": 2,
        "stack_tokens": 4,
        "engine_tokens": 8,
        "first_difference": 2,
    }
    assert load._unequal(([1], 3), [5, 6], [5, 6, 7], 0)["first_difference"] == 2  # cut short
    assert load._unequal(([1], 3), None, [5, 6, 7], 0)["stack_tokens"] is None  # failed
