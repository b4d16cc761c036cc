"""Engine-style chunked prefill through caches the test owns: equal to forward_dense, repeatable.

The loop below is what an engine does per chunk and layer: project, write the rows into its
caches, select over the request's indexer rows, gather in top-k order, attend, finish.
"""

import pytest
import torch

from dsamodel.attention import gather_rows, indexer_topk, sparse_mla_attention
from dsamodel.dense_reference import forward_dense


def run_chunks(model, tokens, bounds):
    """Prefill tokens [T] in chunks [b_i, b_{i+1}) -> logits [T, V]."""
    cfg = model.config
    t = tokens.shape[0]
    # caches start as NaN: any read of an unwritten row would poison the logits
    kv = [torch.full((t, cfg.kv_row_width), float("nan"), dtype=model.dtype) for _ in model.layers]
    idx_k = [torch.full((t, cfg.index_head_dim), float("nan"), dtype=model.dtype) for _ in model.layers]
    logits = []
    edges = [0, *bounds, t]
    for start, end in zip(edges[:-1], edges[1:]):
        positions = torch.arange(start, end)
        h = model.embed(tokens[start:end])
        for layer in model.layers:
            i = layer.cache_index
            proj = layer.project(h, positions)
            kv[i][start:end] = proj.kv
            idx_k[i][start:end] = proj.index_k
            topk = indexer_topk(proj.index_q, proj.index_w, idx_k[i][:end], positions, cfg.index_topk)
            rows, valid = gather_rows(kv[i][:end], topk)
            latent = sparse_mla_attention(proj.q_latent, proj.q_rope, rows, valid, layer.softmax_scale)
            h = layer.finish(h, latent)
        logits.append(model.logits(h))
    return torch.cat(logits)


def test_one_chunk_is_bit_identical_to_forward_dense(model_bf16, prompt):
    tokens = prompt(200)
    assert torch.equal(run_chunks(model_bf16, tokens, []), forward_dense(model_bf16, tokens))


def test_two_chunks_match_dense(model_fp32, prompt):
    tokens = prompt(320, seed=4)
    chunked = run_chunks(model_fp32, tokens, [137])
    torch.testing.assert_close(chunked, forward_dense(model_fp32, tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_same_boundaries_are_bit_identical(model_fp32, model_bf16, prompt, dtype):
    model = model_fp32 if dtype == "fp32" else model_bf16
    tokens = prompt(300, seed=5)
    first = run_chunks(model, tokens, [64, 200])
    assert bool(torch.isfinite(first).all())
    assert torch.equal(run_chunks(model, tokens, [64, 200]), first)


def test_long_prompt_chunks_are_bit_identical(model_bf16, prompt):
    tokens = prompt(2048, seed=6)  # 32x index_topk: real sparsity in every chunk but the first
    first = run_chunks(model_bf16, tokens, [512, 1300])
    assert torch.equal(run_chunks(model_bf16, tokens, [512, 1300]), first)
