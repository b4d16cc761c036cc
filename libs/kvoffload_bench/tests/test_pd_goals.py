"""``kvoffload bench pd`` judges a goal only on a figure it measured: a stream whose tokens all arrive
in one chunk gives no TPOT, a round whose decode timed no pull gives no pull rate, and either goal is
then not met, with the reason in ``not_measured``; equal greedy tokens are a goal of their own.

``run`` is driven end to end with the stack's transport replaced (no services start): the proxy's
stream, the decode's pull counters and the single-process engine's token times are given, so each
case is exact."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from kvoffload_bench import pd as bench_pd

TOKENS = [11, 12, 13, 14, 15, 16]


class _Stack:
    """The stack, reduced to its proxy URL."""

    def __init__(self, cfg) -> None:
        self.url = "http://proxy.invalid"

    def __enter__(self) -> _Stack:
        return self

    def __exit__(self, *exc) -> None:
        return None


class _Response:
    """A streamed completion whose every token comes in one SSE event (one chunk)."""

    def __init__(self, tokens: list[int]) -> None:
        self.lines = [f"data: {json.dumps({'choices': [{'token_ids': tokens}]})}\n".encode(), b"data: [DONE]\n"]

    def __enter__(self) -> list[bytes]:
        return self.lines

    def __exit__(self, *exc) -> None:
        return None


class _Engine:
    """The single-process engine: ``single_tokens`` per request, one every 10 ms."""

    single_tokens = TOKENS

    def __init__(self, model_dir: Path, **sizes) -> None:
        pass

    def run(self, tag, work, after_step=None):
        t0 = time.perf_counter()
        return (
            t0,
            [list(self.single_tokens) for _ in work],
            [[t0 + 0.01 * (i + 1) for i in range(len(TOKENS))] for _ in work],
        )

    def close(self) -> None:
        pass


def _tiny_config(path: Path) -> Path:
    from dsamodel.presets import tiny_config

    path.mkdir(parents=True, exist_ok=True)
    tiny_config().to_json(path / "config.json")
    return path


@pytest.fixture
def stack(monkeypatch):
    """Replaces the stack's transport; returns a setter of the decode's pull time per round (ms)."""
    import kvoffload_testing.oracle
    import kvoffload_testing.stack
    import kvoffload_testing.stack_client
    import kvoffload_testing.stack_config

    pull = {"ms": 5.0}
    calls = itertools.count()
    monkeypatch.setattr(kvoffload_testing.stack, "Stack", _Stack)
    monkeypatch.setattr(
        kvoffload_testing.stack_client, "stack_stats", lambda cfg: _decode_stats(next(calls), pull["ms"])
    )
    monkeypatch.setattr(kvoffload_testing.stack_config, "ensure_tiny_model", _tiny_config)
    monkeypatch.setattr(kvoffload_testing.oracle, "TimedEngine", _Engine)
    monkeypatch.setattr(bench_pd.urllib.request, "urlopen", lambda req, timeout: _Response(TOKENS))
    return pull


def _decode_stats(call: int, ms: float) -> dict:
    """The decode's counters at its ``call``-th read (a before and an after per round): one pull of
    1000 bytes taking ``ms`` per round."""
    n = (call + 1) // 2
    return {"decode-0": {"bytes_read": 1000 * n, "read_ms_total": ms * n, "read_done": n}}


def _run() -> dict:
    return bench_pd.run(
        requests=1,
        prompt_tokens=8,
        max_tokens=len(TOKENS),
        rounds=1,
        idle_pull=False,
        tp=False,
        backends=False,
        across=False,
    )


def test_a_stream_in_one_chunk_measures_no_tpot_and_meets_no_tpot_goal(stack):
    r = _run()
    json.dumps(r)
    assert r["per_round"][0]["pd_tpot_s"] is None and r["tpot_ratio"] is None  # not 0.0
    assert r["goals_met"]["tpot_ratio"] is False
    assert "one chunk" in r["not_measured"]["tpot_ratio"] and "round(s) [0]" in r["not_measured"]["tpot_ratio"]
    # the pull was measured (1000 bytes in 5 ms), and the goals cover the tokens too
    assert r["pull_gbps_in_stack"] == pytest.approx(1000 / 0.005 / 1e9)
    assert (
        set(r["goals"]) == set(r["goals_met"]) == {"tpot_ratio", "pull_gbps_in_stack_ratio_to_memcpy", "tokens_equal"}
    )
    assert r["goals_met"]["tokens_equal"] is True and "pull_gbps_in_stack_ratio_to_memcpy" not in r["not_measured"]


def test_a_round_without_a_timed_pull_measures_no_pull_rate(stack):
    stack["ms"] = 0.0  # the decode's bytes grew, its pull time did not
    r = _run()
    assert r["pull_gbps_in_stack"] is None and r["pull_gbps_in_stack_ratio_to_memcpy"] is None  # not 0.0
    assert r["goals_met"]["pull_gbps_in_stack_ratio_to_memcpy"] is False
    assert "timed no pull" in r["not_measured"]["pull_gbps_in_stack_ratio_to_memcpy"]


def test_unequal_greedy_tokens_are_a_goal_not_met(stack, monkeypatch):
    monkeypatch.setattr(_Engine, "single_tokens", [*TOKENS[:-1], 99])
    r = _run()
    assert r["tokens_equal"] is False and r["goals_met"]["tokens_equal"] is False


def test_tpot_of_a_stream_is_not_measured_without_two_distinct_late_stamps():
    assert bench_pd._tpot([0.5, 0.5, 0.5, 0.5, 1.0, 1.2, 1.2, 1.6]) == pytest.approx(0.2)
    assert bench_pd._tpot([0.5, 0.6]) is None  # one token in the second half: no gap
    assert bench_pd._tpot([0.5, 0.6, 0.9, 0.9, 0.9]) is None  # the second half arrived at once
