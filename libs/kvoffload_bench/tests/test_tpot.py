"""TPOT as the P/D benchmarks compute it from a stream's token arrival times: tokens a server sends
in one chunk (it fell behind) still count at the rate they were produced, never as 0."""

import pytest

from kvoffload_bench import pd as bench_pd
from kvoffload_bench import vllm_stream as bench_vllm


def test_tokens_that_arrive_in_one_chunk_do_not_make_tpot_zero():
    # 7 tokens after the first over 0.7 s, five of them in two chunks
    stamps = [1.0, 1.1, 1.4, 1.4, 1.4, 1.7, 1.7, 1.7]
    assert bench_vllm.tpot(stamps) == pytest.approx(0.1)
    assert bench_vllm.tpot([2.0]) is None  # one token: nothing to time
    # bench pd: the second half only (the first tokens may come in one burst)
    assert bench_pd._tpot([0.5, 0.5, 0.5, 0.5, 1.0, 1.2, 1.2, 1.6]) == pytest.approx(0.2)
    assert bench_pd._tpot([0.5, 0.6]) is None  # one token in the second half: not measured


def test_a_stream_with_every_token_in_one_event_takes_the_servers_inter_token_latency(monkeypatch):
    """A server whose API process fell behind merges all outputs into one event: the stream has no
    timing, so the round's TPOT is the server's own (Δ sum / Δ count of its ITL histogram)."""
    streams = iter([(0.5, ["a", "b", "c"], [0.5, 0.5, 0.5]), (0.4, ["a", "b", "c"], [0.4, 0.6, 0.8])])
    reads = iter(
        [
            {bench_vllm.ITL[0]: 1.0, bench_vllm.ITL[1]: 10},
            {bench_vllm.ITL[0]: 1.3, bench_vllm.ITL[1]: 13},
            {bench_vllm.ITL[0]: 1.3, bench_vllm.ITL[1]: 13},
        ]
    )
    monkeypatch.setattr(bench_vllm, "stream", lambda *a: next(streams))
    monkeypatch.setattr(bench_vllm, "settled", lambda url, names: next(reads))
    merged, streamed = bench_vllm.timed_rounds("proxy", "m", 2, 10, 3, "decode")
    assert (merged["tpot_source"], merged["tpot_s"]) == ("server", pytest.approx(0.1))
    assert (streamed["tpot_source"], streamed["tpot_s"]) == ("stream", pytest.approx(0.2))
    reads = iter([{bench_vllm.ITL[0]: 1.0, bench_vllm.ITL[1]: 10}] * 2)
    streams = iter([(0.5, ["a", "b"], [0.5, 0.5])])
    with pytest.raises(RuntimeError, match="cannot be measured"):
        bench_vllm.timed_rounds("proxy", "m", 1, 10, 2, "decode")


def test_a_stream_of_one_token_has_no_tpot_to_judge(monkeypatch):
    """One token (the model stopped at once) gives no time per output token: the round fails with
    the reason instead of a TPOT of 0 that a ratio would count as fast."""
    reads = {bench_vllm.ITL[0]: 1.0, bench_vllm.ITL[1]: 10}
    monkeypatch.setattr(bench_vllm, "stream", lambda *a: (0.5, ["a"], [0.5]))
    monkeypatch.setattr(bench_vllm, "settled", lambda url, names: reads)
    with pytest.raises(RuntimeError, match="a TPOT needs two"):
        bench_vllm.timed_rounds("proxy", "m", 1, 10, 1, "decode")
