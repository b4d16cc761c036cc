"""ModelConfig: HF keys, a realistic DeepSeek-V3.2 config.json, derived sizes, errors naming keys."""

import json

import pytest
import torch

from dsamodel.config import ModelConfig
from dsamodel.presets import tiny_config

# The shape of the public DeepSeek-V3.2 config.json (no weights needed): MoE, YaRN and fp8 keys
# this library ignores alongside the ones it reads.
DSV32_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v32",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.2",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_real_deepseek_v32_config_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DSV32_CONFIG))
    cfg = ModelConfig.from_json(tmp_path)  # a directory works as well as the file
    assert cfg == ModelConfig.from_json(tmp_path / "config.json")
    assert cfg.q_lora_rank == 1536 and cfg.index_topk == 2048 and cfg.intermediate_size == 18432
    assert cfg.qk_head_dim == 192
    assert cfg.kv_row_width == 576
    assert cfg.num_cache_layers == 62
    assert cfg.dtype == torch.bfloat16
    assert cfg.rope_theta == 10000 and cfg.bos_token_id == 0 and cfg.eos_token_id == 1
    assert cfg.softmax_scale == pytest.approx(192**-0.5)
    assert ModelConfig.from_dict({**DSV32_CONFIG, "architectures": ["DeepseekV32ForCausalLM"]}).architectures == (
        "DeepseekV32ForCausalLM",
    )


def test_round_trip_and_defaults(tmp_path):
    cfg = tiny_config()
    assert ModelConfig.from_json(cfg.to_json(tmp_path / "config.json")) == cfg
    minimal = {
        k: v
        for k, v in DSV32_CONFIG.items()
        if k
        not in (
            "q_lora_rank",
            "num_nextn_predict_layers",
            "rms_norm_eps",
            "rope_theta",
            "torch_dtype",
            "bos_token_id",
            "eos_token_id",
            "tie_word_embeddings",
        )
    }
    cfg = ModelConfig.from_dict(minimal)
    assert cfg.q_lora_rank is None and cfg.num_nextn_predict_layers == 0 and cfg.num_cache_layers == 61
    assert ModelConfig.from_dict({**DSV32_CONFIG, "q_lora_rank": None}).q_lora_rank is None


@pytest.mark.parametrize("key", ["hidden_size", "kv_lora_rank", "index_topk", "vocab_size"])
def test_missing_required_key_is_named(key):
    data = {k: v for k, v in DSV32_CONFIG.items() if k != key}
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(data)


@pytest.mark.parametrize(
    "key, value",
    [
        ("hidden_size", 0),
        ("num_attention_heads", "128"),
        ("index_topk", True),
        ("q_lora_rank", -1),
        ("qk_rope_head_dim", 63),
        ("index_head_dim", 32),
        ("torch_dtype", "float16"),
        ("rms_norm_eps", 0),
        ("rope_theta", "big"),
        ("eos_token_id", 200000),
        ("num_nextn_predict_layers", -1),
        ("tie_word_embeddings", "no"),
        ("architectures", "DeepseekV32ForCausalLM"),
    ],
)
def test_bad_values_are_named(key, value):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict({**DSV32_CONFIG, key: value})


def test_unreadable_config(tmp_path):
    with pytest.raises(ValueError, match="no model config"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_dict([1, 2])
