"""TPOT as the P/D benchmarks compute it from a stream's token arrival times: tokens a server sends
in one chunk (it fell behind) still count at the rate they were produced, never as 0."""
import pytest

from kvoffload import bench_pd, bench_vllm


def test_tokens_that_arrive_in_one_chunk_do_not_make_tpot_zero():
    # 7 tokens after the first over 0.7 s, five of them in two chunks
    stamps = [1.0, 1.1, 1.4, 1.4, 1.4, 1.7, 1.7, 1.7]
    assert bench_vllm._tpot(stamps) == pytest.approx(0.1)
    assert bench_vllm._tpot([2.0]) == 0.0
    # bench pd: the second half only (the first tokens may come in one burst)
    assert bench_pd._tpot([0.5, 0.5, 0.5, 0.5, 1.0, 1.2, 1.2, 1.6]) == pytest.approx(0.2)
    assert bench_pd._tpot([0.5, 0.6]) == 0.0
