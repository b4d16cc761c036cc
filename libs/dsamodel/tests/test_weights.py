"""Weights: HF names, save/load round trip, dtype casts, and errors listing every bad tensor."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsamodel.dense_reference import forward_dense
from dsamodel.model import DSAModel
from dsamodel.presets import init_weights, tiny_config, tiny_model
from dsamodel.weights import checkpoint_shapes, load_model, load_weights, save_model, save_weights


def test_checkpoint_names_follow_hf_deepseek(model_fp32):
    names = set(checkpoint_shapes(model_fp32))
    layer = "model.layers.0."
    for suffix in (
        "input_layernorm.weight",
        "self_attn.q_a_proj.weight",
        "self_attn.q_a_layernorm.weight",
        "self_attn.q_b_proj.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.indexer.wq_b.weight",
        "self_attn.indexer.wk.weight",
        "self_attn.indexer.k_norm.weight",
        "self_attn.indexer.k_norm.bias",
        "self_attn.indexer.weights_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ):
        assert layer + suffix in names
    for name in (
        "model.layers.4.enorm.weight",
        "model.layers.4.hnorm.weight",
        "model.layers.4.eh_proj.weight",
        "model.layers.4.shared_head.norm.weight",
        "model.layers.4.self_attn.indexer.wk.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert name in names
    assert not any(".enorm." in n for n in names if n.startswith("model.layers.3."))
    shapes = checkpoint_shapes(model_fp32)
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == (4 * (32 + 32), 192)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (192 + 16, 128)
    assert shapes["model.layers.4.eh_proj.weight"] == (128, 256)


def test_round_trip_is_exact(tmp_path, model_fp32, prompt):
    save_model(model_fp32, tmp_path)
    loaded = load_model(tmp_path)
    tokens = prompt(64)
    assert torch.equal(forward_dense(loaded, tokens), forward_dense(model_fp32, tokens))
    as_bf16 = load_model(tmp_path, dtype="bfloat16")
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16.lm_head.weight, model_fp32.lm_head.weight.to(torch.bfloat16))


def test_sharded_checkpoint_loads(tmp_path, model_fp32):
    tensors = load_file(str(save_weights(model_fp32, tmp_path / "full.safetensors")))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(tmp_path / "a.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(tmp_path / "b.safetensors"))
    weight_map = {n: "a.safetensors" if i < half else "b.safetensors" for i, n in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(__import__("json").dumps({"weight_map": weight_map}))
    model = load_weights(DSAModel(model_fp32.config), tmp_path)
    assert torch.equal(model.model.layers[4].eh_proj.weight, model_fp32.model.layers[4].eh_proj.weight)


def test_bad_checkpoint_lists_every_problem(tmp_path, model_fp32):
    tensors = load_file(str(save_weights(model_fp32, tmp_path / "good.safetensors")))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.experts.0.up_proj.weight"] = torch.zeros(2, 2)
    tensors["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(3, 64)
    tensors["model.layers.0.self_attn.indexer.wk.weight"] = torch.zeros(32, 128, dtype=torch.int32)
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError) as err:
        load_weights(DSAModel(model_fp32.config), tmp_path / "bad.safetensors")
    msg = str(err.value)
    for fragment in (
        "missing (2)",
        "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight",
        "unexpected (1)",
        "experts.0",
        "mis-shaped (1)",
        "kv_b_proj.weight: [3, 64] (expected [256, 192])",
        "non-floating (1)",
        "indexer.wk.weight: torch.int32",
    ):
        assert fragment in msg
    with pytest.raises(ValueError, match="no weights file"):
        load_weights(DSAModel(model_fp32.config), tmp_path / "absent.safetensors")


def test_plain_q_proj_and_tied_embeddings(tmp_path):
    cfg = dataclasses.replace(tiny_config(dtype="float32"), q_lora_rank=None, tie_word_embeddings=True)
    model = init_weights(DSAModel(cfg), seed=3)
    names = checkpoint_shapes(model)
    assert "model.layers.0.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    assert not any("q_a_proj" in n or "q_b_proj" in n for n in names)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = torch.arange(40)
    assert torch.equal(forward_dense(loaded, tokens), forward_dense(model, tokens))
    # an explicit lm_head must then equal the embeddings
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_model(tmp_path)


def test_model_rejects_unsupported_dtype():
    with pytest.raises(ValueError, match="dtype"):
        DSAModel(tiny_config(), dtype=torch.float16)
    assert tiny_model(dtype="bfloat16").dtype == torch.bfloat16
