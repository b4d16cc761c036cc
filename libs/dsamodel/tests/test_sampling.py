"""Sampling: greedy, seeded top-p determinism, stop conditions, parameter errors."""

import pytest
import torch

from dsamodel.dense_reference import generate_dense
from dsamodel.sampling import RequestSampler, greedy, sample_top_p
from openai_api.sampling_params import SamplingParams


def logits_row(seed=0, vocab=264):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw(params, steps=20, eos=None):
    sampler = RequestSampler(params, eos_token_id=eos)
    return [sampler.step(logits_row(i)) for i in range(steps)]


def test_greedy():
    row = logits_row()
    assert greedy(row) == int(row.argmax())
    assert greedy(torch.tensor([1.0, 3.0, 3.0])) == 1  # first on ties
    assert draw(SamplingParams(max_tokens=20)) == [int(logits_row(i).argmax()) for i in range(20)]


def test_seeded_sampling_is_deterministic_per_request():
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    assert draw(params) == draw(params)
    assert draw(params) != draw(SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=8))
    # one request's draws do not depend on another request's
    a, b = RequestSampler(params), RequestSampler(SamplingParams(max_tokens=20, temperature=1.0, seed=1))
    interleaved = []
    for i in range(20):
        interleaved.append(a.step(logits_row(i)))
        b.step(logits_row(100 + i))
    assert interleaved == draw(params)


def test_top_p_limits_the_candidates():
    row = torch.tensor([5.0, 4.0, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    assert {sample_top_p(row, 1.0, 0.5, gen) for _ in range(200)} == {0}
    assert {sample_top_p(row, 1.0, 0.95, gen) for _ in range(500)} == {0, 1}
    assert {sample_top_p(row, 100.0, 1.0, gen) for _ in range(500)} == {0, 1, 2, 3}


def test_stop_conditions():
    sampler = RequestSampler(SamplingParams(max_tokens=3), eos_token_id=2)
    assert sampler.step(torch.tensor([0.0, 1.0, 0.0])) == 1 and not sampler.finished
    assert sampler.step(torch.tensor([0.0, 0.0, 1.0])) == 2 and sampler.finish_reason == "eos"
    with pytest.raises(ValueError, match="finished"):
        sampler.step(torch.tensor([1.0, 0.0, 0.0]))
    sampler = RequestSampler(SamplingParams(max_tokens=2, ignore_eos=True), eos_token_id=2)
    sampler.step(torch.tensor([0.0, 0.0, 1.0]))
    assert not sampler.finished
    sampler.step(torch.tensor([0.0, 0.0, 1.0]))
    assert sampler.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -3}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_bad_params(kwargs, key):
    with pytest.raises(ValueError, match=key):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="logits"):
        greedy(torch.zeros(2, 3))


def test_generate_dense_is_deterministic(model_fp32):
    prompt = [256, 72, 105]
    params = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11)
    out = generate_dense(model_fp32, prompt, params)
    assert out == generate_dense(model_fp32, prompt, params) and len(out) <= 6
    greedy_out = generate_dense(model_fp32, prompt, SamplingParams(max_tokens=4))
    assert len(greedy_out) == 4 or greedy_out[-1] == model_fp32.config.eos_token_id
