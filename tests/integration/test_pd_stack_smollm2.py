"""I3 on a real model: SmolLM2-135M-Instruct (a Llama model, 30 layers) with its PCA indexer through
proxy -> prefill -> decode on loopback. The prefill keeps 4 shared buffers for the 30 layers (the
guide's log line), saves every layer to the host pool and announces it; the decode pulls the K/V and
indexer rows and decodes with sparse offload (index_topk 512 over a hot buffer of 1,024 rows, the
full KV in its host pool). Greedy tokens equal the plain full-KV oracle's (``dsamodel.dense_decode``:
the prompt dense, each token over the indexer's top-k of every row, no blocks, pools or hot cache),
for a one-token prompt, a chat of ~1,200 tokens (more than index_topk, so the decode selects) and a
completion, streamed and not; afterwards nothing is held. A Llama model whose indexer was never built
is refused at start-up, naming the command that builds it."""

from __future__ import annotations

import pytest

from dsamodel.auto_tokenizer import load_tokenizer
from kvoffload_testing.model_indexer import served_model
from kvoffload_testing.oracle import greedy_reference
from kvoffload_testing.ports import free_stack_ports
from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_client import post_json, stack_stats, stream_token_ids

pytestmark = [pytest.mark.stack, pytest.mark.slow]

BS = 16
MAX_LEN = 4096
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir():
    return served_model("smollm2")


def _config(model_dir, log_dir) -> StackConfig:
    return StackConfig(
        model=model_dir,
        log_dir=log_dir,
        **free_stack_ports(),
        max_model_len=MAX_LEN,
        block_size=BS,
        topk_buffer_size=1024,
        prefill_pool_gb=0.5,
        decode_dram_gb=1,
    )


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with Stack(_config(model_dir, tmp_path_factory.mktemp("smollm2") / "logs")) as s:
        yield s


@pytest.fixture(scope="module")
def prompts(model_dir) -> dict[str, list[int]]:
    tok = load_tokenizer(model_dir)
    licence = (model_dir / "LICENSE").read_text()[:5200]  # ~1,200 tokens: more rows than index_topk
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": licence + "\n\nWhich licence is this?"}]))
    return {"one": [tok.encode("Hello")[0]], "chat": chat, "text": tok.encode(licence[:2600])}


@pytest.fixture(scope="module")
def reference(model_dir):
    return greedy_reference(model_dir, block_size=BS, max_model_len=MAX_LEN)


@pytest.mark.parametrize("name", ["one", "chat", "text"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_i3_greedy_tokens_equal_the_full_kv_oracle(stack, prompts, reference, name, stream):
    ids = prompts[name]
    assert name == "one" or len(ids) > 512  # past index_topk: the decode's attention is sparse
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
    url = f"{stack.url}/v1/completions"
    got = stream_token_ids(url, body) if stream else post_json(url, body)["choices"][0]["token_ids"]
    assert got == reference(ids, MAX_TOKENS)


def test_the_prefill_keeps_4_buffers_for_30_layers_and_nothing_stays_held(stack, prompts):
    post_json(f"{stack.url}/v1/completions", {"prompt": prompts["text"], "max_tokens": 4, "temperature": 0})
    log = stack.cfg.log_path("prefill-0").read_text()
    # a main (K/V) and an indexer descriptor per layer, merged into those of 1 independent + 3 shared buffers
    assert "Layerwise KV cache reuse merged 60 descriptors into 8 descriptors using 4 buffer assignments." in log
    stats = stack_stats(stack.cfg)
    p, d = stats["prefill-0"], stats["decode-0"]
    assert p["held_slots"] == 0 and d["pool_used_bytes"] == 0 and stats["metastore"]["live_leases"] == 0
    assert d["read_done"] > 0 and d["bytes_read"] > 0  # the decode pulled what it decoded over
    assert d["device_hot_bytes"] > 0 and d["device_indexer_bytes"] > 0


def test_a_llama_model_without_its_indexer_is_refused_at_start_up_naming_the_fix(model_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        (bare / name).symlink_to(model_dir / name)
    with pytest.raises(RuntimeError) as info:
        Stack(_config(bare, tmp_path / "logs")).start()
    assert "without an indexer" in str(info.value) and "kvoffload model fetch smollm2" in str(info.value)
