"""The PCA indexer: a deterministic build, the engine's top-k conventions for ``select`` /
``select_batched``, loading beside the weights, and recall above the recency floor on held-out text."""

import json

import pytest
import torch

from dsamodel.attention import indexer_topk
from dsamodel.hf_tokenizer import HFTokenizer
from dsamodel.indexer_build import build_indexer
from dsamodel.indexer_corpus import CALIBRATION, HELD_OUT
from dsamodel.indexer_recall import attention_recall
from dsamodel.llama import LlamaModel
from dsamodel.llama_reference import forward_llama_dense, forward_llama_sparse
from dsamodel.pca_indexer import INDEXER_META, INDEXER_WEIGHTS, pca_select, pca_select_batched
from dsamodel.weights import load_model

RANK = 8
# 4 files x 512 tokens, each run as 2 prefill chunks of 256: the test's held-out context is 512 tokens
SMALL_BUDGET = {
    "rank": RANK,
    "calibration_tokens": 2048,
    "segment_tokens": 512,
    "chunk_tokens": 256,
    "index_topk": 64,
    "recall_context": None,
}


@pytest.fixture(scope="module")
def smollm2():
    from kvoffload_testing.model_fetch import cached_model

    return cached_model("smollm2", log=lambda line: None)


@pytest.fixture(scope="module")
def indexed(tmp_path_factory, smollm2):
    """SmolLM2's files (symlinked) plus an indexer built on a small budget beside them; the progress calls."""
    model_dir = tmp_path_factory.mktemp("smollm2-indexed")
    for f in sorted(smollm2.iterdir()):
        if f.is_file():  # the weights, the tokenizer: not the indexer's folder
            (model_dir / f.name).symlink_to(f)
    calls = []
    build_indexer(model_dir, progress=lambda done, total, stage: calls.append((done, total)), **SMALL_BUDGET)
    return model_dir, calls


def test_build_is_deterministic_and_reports_progress(indexed, tmp_path):
    model_dir, calls = indexed
    again = build_indexer(model_dir, out_dir=tmp_path, **SMALL_BUDGET)
    for name in (INDEXER_WEIGHTS, INDEXER_META):
        assert (model_dir / name).read_bytes() == (tmp_path / name).read_bytes(), name
    assert [done for done, _ in calls] == sorted(done for done, _ in calls) and calls[-1][0] == calls[-1][1]
    meta = json.loads(again.read_text())
    assert (meta["method"], meta["rank"], meta["index_topk"], meta["index_head_dim"]) == ("pca", RANK, 64, 3 * RANK)
    files = meta["calibration"]["files"]
    assert [f["source"] for f in files] == [s.name for s in CALIBRATION] and meta["calibration"]["tokens"] == 2048
    assert all(len(f["sha256"]) == 64 for f in files) and meta["calibration"]["seed"] is None


def test_load_model_attaches_the_indexer(indexed):
    model = load_model(indexed[0])
    assert isinstance(model, LlamaModel) and model.has_indexer
    cfg = model.config
    assert (cfg.index_rank, cfg.index_head_dim, cfg.index_topk) == (RANK, 3 * RANK, 64)
    assert model.index_codec.storage(model.dtype) == (torch.bfloat16, 3 * RANK)
    basis = model.layers[3].self_attn.pca_indexer.basis  # [KV, hd, r] orthonormal columns
    torch.testing.assert_close(basis.transpose(1, 2) @ basis, torch.eye(RANK).expand(3, RANK, RANK), atol=1e-5, rtol=0)
    tokens = torch.arange(100, 140)
    proj = model.layers[0].project(model.embed(tokens), torch.arange(40))
    assert proj.index_k.shape == (40, 3 * RANK) and proj.index_k.dtype == torch.bfloat16
    assert proj.index_q.shape == (40, 9, RANK) and proj.index_q.dtype == torch.float32
    # every position's top-k holds its whole past when k >= T: the sparse path is the dense one
    torch.testing.assert_close(forward_llama_sparse(model, tokens, 64), forward_llama_dense(model, tokens))


def test_a_lone_indexer_file_is_an_error(indexed, tmp_path):
    for f in indexed[0].iterdir():
        if f.is_file():
            (tmp_path / f.name).symlink_to(f.resolve())
    (tmp_path / INDEXER_WEIGHTS).parent.mkdir()
    (tmp_path / INDEXER_WEIGHTS).symlink_to((indexed[0] / INDEXER_WEIGHTS).resolve())  # the json left out
    with pytest.raises(ValueError, match="rebuild the indexer"):
        load_model(tmp_path)


def _naive_topk(index_q, keys, pos, k, scale):
    """Python reference: softmax mass over the visible keys, summed over heads, top-k (later wins ties)."""
    heads, rank = index_q.shape[0], index_q.shape[1]
    kv_keys = keys[: pos + 1].view(pos + 1, -1, rank)  # [p, KV, r]
    group = heads // kv_keys.shape[1]
    mass = torch.zeros(pos + 1)
    for h in range(heads):
        mass += torch.softmax((kv_keys[:, h // group] @ index_q[h]) * scale, dim=0)
    order = sorted(range(pos + 1), key=lambda s: (-float(mass[s]), -s))[:k]
    return sorted(order) + [-1] * (k - len(order))


def test_select_follows_the_engine_conventions():
    gen = torch.Generator().manual_seed(0)
    heads, kv, rank, c, k = 6, 2, 4, 12, 5
    positions = torch.tensor([0, 1, 3, 4, 7, 11, 11])
    index_q = torch.randn(len(positions), heads, rank, generator=gen)
    keys = torch.randn(c, kv * rank, generator=gen)
    out = pca_select(index_q, keys, positions, k, 0.5)
    assert out.dtype == torch.int64 and out.shape == (len(positions), k)
    for row, pos, q in zip(out.tolist(), positions.tolist(), index_q, strict=True):
        assert row == _naive_topk(q, keys, pos, k, 0.5)  # ascending, -1 padded, causal
    # rows past a query's position never matter, even NaN; chunking never matters
    poisoned = keys.clone()
    poisoned[5:] = float("nan")
    assert torch.equal(pca_select(index_q[:3], poisoned, positions[:3], k, 0.5), out[:3])
    assert torch.equal(pca_select(index_q, keys, positions, k, 0.5, chunk_bytes=1), out)
    # batched (decode): query n over request n's own keys equals the per-request selection
    own = torch.randn(len(positions), c, kv * rank, generator=gen)
    batched = pca_select_batched(index_q, own, positions, k, 0.5)
    for n in range(len(positions)):
        assert torch.equal(batched[n], pca_select(index_q[n : n + 1], own[n], positions[n : n + 1], k, 0.5)[0])
    # equal scores prefer the later token, as dsamodel.attention.indexer_topk does
    flat = pca_select(index_q, torch.ones(c, kv * rank), positions, k, 0.5)
    dsa = indexer_topk(torch.ones(len(positions), 1, 2), torch.ones(len(positions), 1), torch.ones(c, 2), positions, k)
    assert torch.equal(flat, dsa)
    with pytest.raises(ValueError, match="write this chunk's index_k rows"):
        pca_select(index_q, keys[:5], positions, k, 0.5)


def test_recall_beats_the_recency_floor_on_held_out_text(indexed):
    model = load_model(indexed[0])
    ids = HFTokenizer.from_dir(indexed[0]).encode(HELD_OUT[1].text())[:512]
    with torch.inference_mode():
        result = attention_recall(model, torch.tensor(ids), 64, ranks=[4, RANK])
    assert result["context"] == 512 and result["queries"] == 64 and result["layers"] == list(range(30))
    low, full = result["results"]
    assert (low["rank"], full["rank"]) == (4, RANK) and low["indexer"] <= full["indexer"] + 0.01  # more rank, no worse
    assert full["recency"] < full["indexer"] <= full["oracle"] + 1e-6, full
