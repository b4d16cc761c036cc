"""The real model through the engine: SmolLM2-135M-Instruct (a Llama model) with its PCA indexer.

I1 (buffer reuse changes memory, never results: prefill logits and every saved host-pool byte) and I2
(sparse offload equals the same sparse attention with the full KV on the device: decode logits at
every step) on its 30 layers, and the engine's greedy tokens equal to the plainest path
(``dsamodel.dense_decode``: a full KV per layer, no blocks, pools, buffers or hot cache). The index
top-k is made small (64, with a hot buffer of 128) so that a few hundred tokens of context already
make the hot cache hit and miss. The model and its indexer are built once per machine
(``kvoffload_testing.model_indexer.served_model``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_support import prefill_engine, prefill_pool, saved_bytes

from dsamodel.auto_tokenizer import load_tokenizer
from dsamodel.dense_decode import generate_full_kv
from dsamodel.llama import LlamaModel
from dsamodel.served import sparse_ready
from dsamodel.weights import load_model
from kvoffload_engine.engine import Engine, EngineConfig
from kvoffload_engine.prefill import PrefillRequest
from kvoffload_testing.model_indexer import served_model
from openai_api.sampling_params import SamplingParams

BS = 16
TOPK = 64
DOC = (
    "The shared layer buffers hold the KV of a few layers at a time; every layer is saved to the host pool "
    "and a buffer is reused only once its save and every remote read of it finished. "
)


@pytest.fixture(scope="module")
def model_dir():
    return served_model("smollm2")


@pytest.fixture(scope="module")
def model(model_dir) -> LlamaModel:
    m = load_model(model_dir)
    assert isinstance(m, LlamaModel) and m.has_indexer
    m.config = dataclasses.replace(m.config, index_topk=TOPK)  # small: the hot cache works at this length
    return m


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    tok = load_tokenizer(model_dir)

    def chat(n: int, question: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": DOC * n + question}]))

    return [chat(6, "What is a buffer reused after?"), chat(3, "Name what is saved.")]


def _prefill(model, prompt, *, buffers, independent):
    pool = prefill_pool(model, BS, 256 << 20)
    eng = prefill_engine(model, pool, buffers=buffers, independent=independent, chunk_size=96)
    try:
        res = eng.run(PrefillRequest("req", torch.tensor(prompt)))
        out = (res.logits.clone(), res.first_token, saved_bytes(pool, res.keys))
        eng.release(res)
        return out
    finally:
        eng.close()
        pool.close()


@pytest.mark.parametrize("buffers", [1, 2])
def test_i1_shared_buffers_change_no_logit_and_no_saved_byte(model, prompts, buffers):
    want = _prefill(model, prompts[0], buffers=None, independent="all")
    got = _prefill(model, prompts[0], buffers=buffers, independent=[0])
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert len(got[2]) == len(want[2]) == 2 * 30  # the K/V plane and the indexer plane of every layer
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2], strict=True))


def _decode(model, prompts, *, keep: bool):
    eng = Engine(
        model,
        EngineConfig(
            block_size=BS,
            max_model_len=2048,
            max_num_seqs=2,
            chunk_size=128,
            buffers=2,
            topk_buffer_size=2 * TOPK,
            keep_device_kv_cache=keep,
            prefill_pool_bytes=256 << 20,
            decode_pool_bytes=256 << 20,
        ),
    )
    steps: list[torch.Tensor] = []
    real = eng.decoder.forward

    def recording(ids, tokens):
        out = real(ids, tokens)
        steps.append(out[0].clone())
        return out

    eng.decoder.forward = recording  # type: ignore[method-assign]  # this instance's forward, recorded
    hits = misses = 0
    try:
        seqs = [
            eng.add_request(f"r{i}", p, SamplingParams(max_tokens=20, ignore_eos=True)) for i, p in enumerate(prompts)
        ]
        while eng.waiting or eng.running:
            eng.step()
            hits, misses = hits + eng.decoder.last_step.hits, misses + eng.decoder.last_step.misses
        return steps, [s.output_ids for s in seqs], (hits, misses)
    finally:
        eng.close()


def test_i2_sparse_offload_equals_the_same_selection_on_the_device(model, prompts):
    sparse, tokens, (hits, misses) = _decode(model, prompts, keep=False)
    keep, keep_tokens, _ = _decode(model, prompts, keep=True)
    assert len(sparse) == len(keep) >= 19 and tokens == keep_tokens
    assert all(torch.equal(a, b) for a, b in zip(sparse, keep, strict=True))
    assert hits > 0 and misses > 0  # the hot cache both kept rows and loaded them from the host pool


def test_engine_greedy_tokens_are_the_plainest_paths(model, prompts):
    _, tokens, _ = _decode(model, prompts, keep=False)
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == generate_full_kv(model, prompt, SamplingParams(max_tokens=20, ignore_eos=True))


def test_a_llama_model_without_an_indexer_is_refused_naming_the_fix(model_dir, tmp_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).symlink_to(model_dir / name)
    bare = load_model(tmp_path)
    assert "kvoffload model fetch smollm2" in sparse_ready(bare, tmp_path)
    with pytest.raises(ValueError, match="without an indexer .* kvoffload model fetch smollm2"):
        Engine(bare, EngineConfig(max_model_len=256, prefill_pool_bytes=64 << 20, decode_pool_bytes=64 << 20))
