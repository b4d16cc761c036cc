"""The reference demo's request and summary, from a stack's answer and Stats (no stack started)."""

from __future__ import annotations

import json
from pathlib import Path

from kvoffload_testing.reference_demo import DEMO_QUESTION, TINY_PROMPT, demo_body, summary_of
from kvoffload_testing.stack import StackConfig


def _llama_dir(tmp_path: Path) -> Path:
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 128,
        "vocab_size": 100,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "LICENSE").write_text("Apache License\nVersion 2.0")
    return tmp_path


def test_a_real_model_is_asked_about_its_licence_and_the_tiny_one_gets_the_repeated_prompt(tmp_path):
    body = demo_body(_llama_dir(tmp_path), 16)
    assert body["messages"][0]["content"].startswith("Apache License") and body["messages"][0]["content"].endswith(
        DEMO_QUESTION
    )
    (tmp_path / "tokenizer.json").unlink()
    assert demo_body(tmp_path, 16) == {"prompt": TINY_PROMPT, "max_tokens": 16, "temperature": 0}


def test_the_summary_puts_each_side_beside_a_dense_engine_of_the_same_slots(tmp_path):
    cfg = StackConfig(model=_llama_dir(tmp_path), log_dir=tmp_path, max_model_len=8192)
    answer = {"usage": {"prompt_tokens": 2267, "completion_tokens": 32}}
    prefill = {"device_kv_bytes": 4 * 8192 * 864, "pool_used_bytes": 1, "held_slots": 0}
    decode = {"device_kv_bytes": 8 * 30 * (8192 * 0 + 1024 * 768), "max_num_seqs": 8, "bytes_read": 5, "read_done": 60}
    s = summary_of(cfg, answer, {"prefill-0": prefill, "decode-0": {**decode, "pool_used_bytes": 0}}, 1.5)
    slot = 8192 * 30 * 768  # K and V of 3 heads x 64 in bf16, every layer, max_model_len rows
    assert s["request_kv_bytes"] == 2299 * 30 * 768
    assert s["decode_device_kv_ratio_to_dense"] == round(30 * 1024 * 768 / slot, 4) == 0.125
    assert s["prefill_device_kv_ratio_to_dense"] == round(4 * 8192 * 864 / slot, 4)
    assert s["layers"] == 30 and "metastore" not in s
