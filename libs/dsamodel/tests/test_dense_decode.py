"""``generate_full_kv``: ``generate_dense``'s tokens, incrementally, over a full KV per layer."""

import pytest
import torch

from dsamodel.dense_decode import FullKV, generate_full_kv
from dsamodel.dense_reference import forward_dense, forward_hidden, generate_dense
from dsamodel.presets import tiny_model
from openai_api.sampling_params import SamplingParams


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_prompt_as_one_chunk_is_bit_identical_to_forward_dense(model_fp32, model_bf16, prompt, dtype):
    model = model_fp32 if dtype == "fp32" else model_bf16
    tokens = prompt(120, seed=2)  # > index_topk: the selection is sparse
    want = model.logits(forward_hidden(model, tokens)[-1:])[0]  # forward_dense's layers; the LM head on the last row
    assert torch.equal(FullKV(model, 120).forward(tokens), want)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_each_new_token_matches_forward_dense_over_the_whole_sequence(model_fp32, model_bf16, prompt, dtype):
    model = model_fp32 if dtype == "fp32" else model_bf16
    tokens = prompt(100, seed=3)
    cache = FullKV(model, 100)
    cache.forward(tokens[:90])
    steps = torch.stack([cache.forward(tokens[i : i + 1]) for i in range(90, 100)])  # [10, V]
    whole = forward_dense(model, tokens)[90:]  # [10, V]
    tol = 1e-4 if dtype == "fp32" else 2e-2  # one row at a time vs all rows at once: matmul shapes differ
    torch.testing.assert_close(steps, whole, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=6), SamplingParams(max_tokens=4, temperature=0.8, seed=3)],
    ids=["greedy", "seeded"],
)
def test_tokens_equal_generate_dense(model_fp32, prompt, params):
    ids = prompt(80, seed=4).tolist()
    assert generate_full_kv(model_fp32, ids, params) == generate_dense(model_fp32, ids, params)


def test_an_fp8_indexer_selects_from_the_keys_a_cache_holds():
    model = tiny_model(seed=0, dtype="float32", fp8_indexer=True).to(torch.bfloat16)
    ids = list(range(1, 81))
    params = SamplingParams(max_tokens=4)
    assert generate_full_kv(model, ids, params) == generate_dense(model, ids, params)


def test_a_stop_token_ends_generation_early(model_fp32):
    ids = [5, 9, 13]
    first = generate_full_kv(model_fp32, ids, SamplingParams(max_tokens=4))
    stop = first[2]
    got = generate_full_kv(model_fp32, ids, SamplingParams(max_tokens=4, stop_token_ids=(stop,)))
    assert got == first[: first.index(stop) + 1]


def test_rows_past_the_capacity_and_an_empty_prompt_are_refused(model_fp32):
    cache = FullKV(model_fp32, 4)
    cache.forward(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="capacity of 4 rows"):
        cache.forward(torch.tensor([4, 5]))
    with pytest.raises(ValueError, match="at least one token"):
        generate_full_kv(model_fp32, [], SamplingParams(max_tokens=2))
