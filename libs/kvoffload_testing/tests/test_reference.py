"""The stacks' oracle is not the code under test: ``greedy_reference`` builds none of the engine's
machinery, so a deterministic bug in the hot cache's gather or in prefill buffer reuse changes
the engine's greedy tokens and leaves the oracle's as they were; unbroken, the two agree."""

from __future__ import annotations

import pytest
import torch

from dsamodel import dense_decode
from dsamodel.weights import load_model
from kvcore.hotcache import cache as hotcache
from kvcore.hotcache import gather
from kvcore.pool import local as localpool
from kvoffload_engine import buffers, decode_requests, engine, prefill
from kvoffload_engine import decode as decode_module
from kvoffload_engine.engine import Engine, EngineConfig
from kvoffload_testing.oracle import greedy_reference
from kvoffload_testing.stack_config import ensure_tiny_model
from openai_api.sampling_params import SamplingParams

PROMPT = [1] + [7 + (i * 37) % 250 for i in range(299)]  # 300 tokens: sparse top-k, 19 blocks
MAX_TOKENS = 12
SMALL_CHUNKS = dict(chunk_size=32, buffers=3)  # 10 chunks: a slot two layers share reloads at each
# 10 chunks, every reused layer on one buffer: each layer reloads its prefix at each chunk (with 3 buffers
# one slot is shared, and a bug there moved log-probabilities but no greedy token on some CPUs)
ONE_BUFFER = dict(chunk_size=32, buffers=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("oracle") / "tiny")


@pytest.fixture(scope="module")
def oracle_tokens(model_dir):
    return greedy_reference(model_dir, max_model_len=4096)(PROMPT, MAX_TOKENS)


def _engine_tokens(model_dir, **sizes) -> list[int]:
    """The engine with the stacks' sizes (what the oracle used to run), or ``sizes`` instead."""
    cfg = (
        dict(
            block_size=16,
            max_model_len=4096,
            chunk_size=2048,
            buffers=3,
            topk_buffer_size=128,
            prefill_pool_bytes=64 << 20,
            decode_pool_bytes=64 << 20,
        )
        | sizes
    )
    eng = Engine(load_model(model_dir), EngineConfig(**cfg))
    try:
        return eng.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS))[0]
    finally:
        eng.close()


def test_unbroken_the_engine_and_the_oracle_agree(model_dir, oracle_tokens):
    assert len(oracle_tokens) == MAX_TOKENS
    assert _engine_tokens(model_dir) == oracle_tokens
    assert _engine_tokens(model_dir, **SMALL_CHUNKS) == oracle_tokens
    assert _engine_tokens(model_dir, **ONE_BUFFER) == oracle_tokens


def test_the_oracle_builds_none_of_the_engine_machinery(model_dir, oracle_tokens, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the oracle ran the code under test")

    for owner, name in [
        (engine.Engine, "__init__"),
        (prefill.LayerwisePrefill, "__init__"),
        (decode_module.SparseDecoder, "__init__"),
        (buffers.LayerBuffers, "__init__"),
        (hotcache.HotCache, "__init__"),
        (localpool.LocalHostPool, "__init__"),
        (gather, "gather_rows"),
        (gather, "scatter_rows"),
        (decode_module, "gather_rows"),
        (decode_module, "scatter_rows"),
        (decode_requests, "scatter_rows"),
    ]:
        monkeypatch.setattr(owner, name, forbidden)
    assert greedy_reference(model_dir, max_model_len=4096)(PROMPT, MAX_TOKENS) == oracle_tokens


def test_a_hot_cache_gather_bug_changes_the_engine_not_the_oracle(model_dir, oracle_tokens, monkeypatch):
    real = decode_module.gather_rows

    def off_by_one(pool, block_table, miss_rows, miss_tokens, *args, **kwargs):
        """Every miss loads the row of the token before it (token 0 loads its own)."""
        return real(pool, block_table, miss_rows, (miss_tokens - 1).clamp(min=0), *args, **kwargs)

    monkeypatch.setattr(decode_module, "gather_rows", off_by_one)
    assert _engine_tokens(model_dir) != oracle_tokens
    assert greedy_reference(model_dir, max_model_len=4096)(PROMPT, MAX_TOKENS) == oracle_tokens


def test_a_buffer_reuse_bug_changes_the_engine_not_the_oracle(model_dir, oracle_tokens, monkeypatch):
    def never_reload(self, layer: int, request_id: str, num_tokens: int) -> int:
        """A shared slot is taken to still hold the layer's prefix: another layer's rows are read."""
        return num_tokens // self.block_size

    monkeypatch.setattr(buffers.LayerBuffers, "load_from", never_reload)
    assert _engine_tokens(model_dir, **ONE_BUFFER) != oracle_tokens
    assert greedy_reference(model_dir, max_model_len=4096)(PROMPT, MAX_TOKENS) == oracle_tokens


def test_prompts_past_max_model_len_are_refused_and_answers_are_cached(model_dir, monkeypatch):
    calls = []
    real = dense_decode.generate_full_kv
    monkeypatch.setattr(dense_decode, "generate_full_kv", lambda *args: calls.append(args) or real(*args))
    run = greedy_reference(model_dir, max_model_len=64)
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        run(list(range(1, 60)), 8)
    threads = torch.get_num_threads()
    assert run([65, 66], 3) == run([65, 66], 3) and len(calls) == 1
    assert torch.get_num_threads() == threads  # the oracle's one thread was for its own work
