"""The absorbed sparse path against the textbook path, and the indexer's real effect."""

import pytest
import torch

from dsamodel.attention import indexer_topk
from dsamodel.dense_reference import forward_dense, forward_dense_mtp, forward_naive


def recording_selector(store):
    """The indexer's own choice, recorded per cache layer."""

    def select(cache_index, proj, positions):
        store[cache_index] = indexer_topk(proj.index_q, proj.index_w, proj.index_k, positions, 64)
        return store[cache_index]

    return select


def replay_selector(store):
    return lambda cache_index, proj, positions: store[cache_index]


def recency_selector(cache_index, proj, positions):
    idx = positions[:, None] - torch.arange(63, -1, -1)[None, :]  # the last 64 tokens, ascending
    return torch.where(idx >= 0, idx, -1)


def test_absorbed_equals_naive_fp32(model_fp32, prompt):
    tokens = prompt(160)
    dense, naive = forward_dense(model_fp32, tokens), forward_naive(model_fp32, tokens)
    torch.testing.assert_close(dense, naive, rtol=1e-4, atol=1e-4)
    # a long prompt, same selections on both sides (selection near-ties are not the point here)
    tokens = prompt(1024, seed=2)
    selected = {}
    dense = forward_dense(model_fp32, tokens, selector=recording_selector(selected))
    naive = forward_naive(model_fp32, tokens, selector=replay_selector(selected))
    torch.testing.assert_close(dense, naive, rtol=1e-4, atol=1e-4)


def test_absorbed_equals_naive_bf16(model_bf16, model_fp32, prompt):
    tokens = prompt(256)
    selected = {}
    dense = forward_dense(model_bf16, tokens, selector=recording_selector(selected))
    naive = forward_naive(model_bf16, tokens, selector=replay_selector(selected))
    assert dense.dtype == torch.float32
    torch.testing.assert_close(dense, naive, rtol=0.02, atol=0.1)  # bf16 roundings differ by path
    assert float((dense - naive).abs().mean()) < 0.02
    reference = forward_dense(model_fp32, tokens, selector=replay_selector(selected))
    torch.testing.assert_close(dense, reference, rtol=0.02, atol=0.1)


def test_indexer_really_selects(model_fp32, prompt):
    tokens = prompt(1024, seed=3)
    selected = {}
    logits = forward_dense(model_fp32, tokens, selector=recording_selector(selected))
    positions = torch.arange(1024)
    for cache_index, topk in selected.items():
        full = topk[512:]  # queries that see far more than index_topk tokens
        assert bool((full >= 0).all()) and bool((full <= positions[512:, None]).all())
        assert len({tuple(row.tolist()) for row in full}) == len(full)  # every query its own set
        recent = (full > positions[512:, None] - 64).float().mean()
        assert float(recent) < 0.5, f"layer {cache_index} mostly picks the last 64 tokens"
        assert bool((topk[:64] == torch.where(torch.arange(64) <= positions[:64, None], torch.arange(64), -1)).all())
    other = forward_dense(model_fp32, tokens, selector=recency_selector)
    assert float((logits - other)[512:].abs().max()) > 0.1
    assert torch.equal(other[:64], logits[:64])  # below index_topk every token is attended either way


def test_mtp_dense(model_fp32, prompt):
    tokens = prompt(40)
    (mtp,) = forward_dense_mtp(model_fp32, tokens)
    assert mtp.shape == (39, model_fp32.config.vocab_size) and bool(torch.isfinite(mtp).all())
    assert torch.equal(forward_dense_mtp(model_fp32, tokens)[0], mtp)
    # row i of MTP depth 0 depends on tokens 0..i+1 only
    (prefix,) = forward_dense_mtp(model_fp32, tokens[:21])
    torch.testing.assert_close(prefix, mtp[:20], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_tiny_prompts(model_fp32, num_tokens):
    tokens = torch.arange(num_tokens)
    torch.testing.assert_close(forward_dense(model_fp32, tokens), forward_naive(model_fp32, tokens))
