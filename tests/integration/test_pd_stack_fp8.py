"""The P/D stack on a model whose indexer cache is fp8 (the tiny preset with ``fp8_indexer``:
architecture DeepseekV32ForCausalLM, keys as float8_e4m3fn plus one float32 scale per 128
elements, DeepSeek-V3.2's format): the prefill's layer buffers and pool, the layout handshake, the
P→D pull and the decode's device cache carry those byte rows. I3: greedy tokens through the proxy
equal the single-process engine's on the same model; the decode pulled exactly one copy of each
prompt's rows at the fp8 row size (key bytes + scale bytes)."""

from __future__ import annotations

import pytest
import torch

from dsamodel.presets import write_tiny
from dsamodel.tokenizer import ByteTokenizer
from dsamodel.weights import load_model
from kvoffload_engine.model_layout import kv_layout
from kvoffload_testing.oracle import greedy_reference
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import post_json, stack_stats, stream_token_ids

pytestmark = [pytest.mark.stack, pytest.mark.slow]

BS = 16
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def fp8_model_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("model") / "tiny-fp8", fp8_indexer=True)


@pytest.fixture(scope="module")
def stack(fp8_model_dir, tmp_path_factory):
    cfg = StackConfig(
        model=fp8_model_dir,
        log_dir=tmp_path_factory.mktemp("fp8-stack") / "logs",
        **free_stack_ports(),
        max_model_len=4096,
        block_size=BS,
    )
    with Stack(cfg) as s:
        yield s


def test_the_layout_has_fp8_indexer_rows(fp8_model_dir):
    model = load_model(fp8_model_dir)
    spec = kv_layout(model.config, BS, model.dtype).layers[0].indexer
    assert (spec.dtype, spec.row_bytes) == (torch.float8_e4m3fn, 32 + 4)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_i3_with_an_fp8_indexer_and_one_copy_pulled(stack, fp8_model_dir, stream):
    reference = greedy_reference(fp8_model_dir, block_size=BS, max_model_len=4096)
    model = load_model(fp8_model_dir)
    per_token = sum(layer.row_bytes for layer in kv_layout(model.config, BS, model.dtype).layers)
    for n in (1, BS - 1, 1200):
        ids = TOK.encode("".join(chr(33 + (i * 13) % 90) for i in range(n)), add_bos=True)[:n]
        before = stack_stats(stack.cfg)["decode-0"]["bytes_read"]
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0}
        url = f"{stack.url}/v1/completions"
        got = stream_token_ids(url, body) if stream else post_json(url, body)["choices"][0]["token_ids"]
        assert got == reference(ids, 8)
        assert stack_stats(stack.cfg)["decode-0"]["bytes_read"] - before == len(ids) * per_token
