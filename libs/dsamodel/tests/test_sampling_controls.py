"""Penalties, min_tokens, stop strings / stop token ids, logprobs, accept() (the sampler's side;
StopText's hold-back is tested in libs/openai_api/tests/test_stop_text.py)."""

import pytest
import torch

from dsamodel.sampling import RequestSampler, token_logprob
from dsamodel.tokenizer import ByteTokenizer
from openai_api.sampling_params import SamplingParams

TOK = ByteTokenizer()


def row(*favourites, vocab=264):
    """Logits preferring favourites[0], then favourites[1], ..."""
    out = torch.zeros(vocab)
    for k, t in enumerate(favourites):
        out[t] = 10.0 - k
    return out


def test_logprobs_are_log_softmax_of_the_raw_logits():
    logits = torch.randn(264, generator=torch.Generator().manual_seed(3)) * 4
    params = SamplingParams(max_tokens=2, temperature=0.7, seed=1, logprobs=3, frequency_penalty=1.0)
    s = RequestSampler(params, eos_token_id=257)
    tok = s.step(logits)
    ref = torch.log_softmax(logits, -1)
    assert s.logprobs[0].token == tok and s.logprobs[0].logprob == pytest.approx(float(ref[tok]))
    top = torch.topk(ref, 3)
    assert [t for t, _ in s.logprobs[0].top] == top.indices.tolist()
    assert token_logprob(logits, 5, 0).top == ()


def test_penalties_follow_the_counts():
    s = RequestSampler(SamplingParams(max_tokens=5, frequency_penalty=0.6), eos_token_id=None)
    logits = row(65, 66)  # 65 leads by 1.0
    assert [s.step(logits) for _ in range(3)] == [65, 65, 66]  # after two 65s it is 1.2 behind
    s = RequestSampler(SamplingParams(max_tokens=3, presence_penalty=2.0), eos_token_id=None)
    assert [s.step(logits) for _ in range(3)] == [65, 66, 65]  # 65 and 67 tie at 8: the first wins


def test_min_tokens_bans_eos_and_stop_ids_then_they_stop():
    eos = TOK.eos_token_id
    s = RequestSampler(SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=(70,)), eos_token_id=eos)
    assert s.step(row(eos, 70, 65)) == 65 and not s.finished
    assert s.step(row(70, eos, 66)) == 66 and not s.finished
    assert s.step(row(70)) == 70 and s.finish_reason == "stop"
    s = RequestSampler(SamplingParams(max_tokens=5, min_tokens=1, ignore_eos=True), eos_token_id=eos)
    assert s.step(row(eos, 65)) == 65
    assert s.step(row(eos)) == eos and not s.finished  # ignore_eos


def test_stop_strings_end_the_sequence_once_min_tokens_passed():
    s = RequestSampler(SamplingParams(max_tokens=9, stop=("ab",)), eos_token_id=None)
    for t in b"xa":
        s.step(row(t))
    assert not s.finished
    s.step(row(ord("b")))
    assert s.finish_reason == "stop"
    s = RequestSampler(SamplingParams(max_tokens=9, stop=("a",), min_tokens=3), eos_token_id=None)
    for t in b"aax":
        s.step(row(t))
    assert not s.finished  # the "a"s came before min_tokens
    s.step(row(ord("a")))
    assert s.finished


def test_accept_keeps_the_generator_in_step():
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=4)
    rows = [torch.randn(264, generator=torch.Generator().manual_seed(i)) for i in range(6)]
    whole = RequestSampler(params)
    ids = [whole.step(r) for r in rows]
    split = RequestSampler(params)
    split.accept(ids[0])
    assert [ids[0]] + [split.step(r) for r in rows[1:]] == ids
