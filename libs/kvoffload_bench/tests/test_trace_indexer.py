"""The live indexer's trace (``kvoffload_bench.trace_indexer``) is what the engine's sparse decode selects.

Recorded on SmolLM2 with its indexer (built once per machine) over a short prompt, the trace has one
stream per layer, every selection a set of distinct visible positions; replayed on the engine
(``TraceTopK``) it gives the recorded tokens, and the engine's own indexer, not overridden, gives
them too: the trace is the engine's selection, not an approximation of it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from dsamodel.weights import load_model
from kvoffload_bench.trace_indexer import record_indexer
from kvoffload_bench.trace_prompts import prompt_ids
from kvoffload_engine.engine import Engine, EngineConfig
from kvoffload_engine.trace_topk import TraceTopK
from kvoffload_testing.model_indexer import served_model
from openai_api.sampling_params import SamplingParams

CONTEXT, STEPS, TOPK, LAYERS = 300, 6, 32, 30


@pytest.fixture(scope="module")
def model_dir():
    return served_model("smollm2")


@pytest.fixture(scope="module")
def trace(model_dir):
    # "model" attention: the prompt's rows bit-exact with the engine's prefill
    return record_indexer(model_dir, context=CONTEXT, steps=STEPS, topk=TOPK, requests=1, attention="model")


def test_one_stream_per_layer_of_distinct_visible_positions(trace):
    assert trace.topk.shape == (LAYERS, STEPS, TOPK)
    assert trace.layers.tolist() == list(range(LAYERS))
    assert trace.requests.tolist() == [0] * LAYERS and trace.groups.tolist() == [0] * LAYERS
    assert trace.context0.tolist() == [CONTEXT + 1] * LAYERS
    for t in range(STEPS):
        rows = trace.topk[:, t]  # [layers, k]: step t's query at position CONTEXT + t sees CONTEXT + t + 1 tokens
        assert bool((rows >= 0).all()) and bool((rows <= CONTEXT + t).all())
        assert all(len(set(row)) == TOPK for row in rows.tolist())
    assert trace.meta["selector"] == "indexer" and trace.meta["topk"] == TOPK
    assert len(trace.meta["generated_ids"][0]) == STEPS + 1
    # the layers choose differently: a trace of one layer's choice copied 30 times would not
    assert len({tuple(trace.topk[layer, 0].tolist()) for layer in range(LAYERS)}) > LAYERS // 2


def _engine_tokens(model_dir, trace=None) -> list[int]:
    model = load_model(model_dir)
    model.config = dataclasses.replace(model.config, index_topk=TOPK)
    prompt = prompt_ids(AutoTokenizer.from_pretrained(model_dir), context=CONTEXT, requests=1)[0][0]
    eng = Engine(
        model,
        EngineConfig(
            block_size=16,
            max_model_len=512,
            max_num_seqs=1,
            chunk_size=128,
            topk_buffer_size=2 * TOPK,
            prefill_pool_bytes=64 << 20,
            decode_pool_bytes=64 << 20,
        ),
    )
    try:
        if trace is not None:
            eng.decoder.topk_override = TraceTopK(trace, ["r"], num_layers=LAYERS)
        seq = eng.add_request("r", prompt.tolist(), SamplingParams(max_tokens=STEPS + 1, ignore_eos=True))
        while eng.waiting or eng.running:
            eng.step()
        return seq.output_ids
    finally:
        eng.close()


def test_the_engine_replaying_the_trace_and_the_engine_alone_decode_the_recorded_tokens(model_dir, trace):
    want = trace.meta["generated_ids"][0]
    assert _engine_tokens(model_dir, trace) == want
    assert _engine_tokens(model_dir) == want


def test_a_trace_of_other_selections_changes_the_engine_s_tokens(model_dir, trace):
    """The replay test above can fail: selections that keep only the earliest positions decode else."""
    early = torch.arange(TOPK, dtype=torch.int32).expand(trace.topk.shape).contiguous()
    assert _engine_tokens(model_dir, dataclasses.replace(trace, topk=early)) != trace.meta["generated_ids"][0]
