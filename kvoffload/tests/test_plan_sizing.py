"""``kvoffload plan`` sizing: the guide's configs on a DeepSeek-V3.2 config.json, and bad configs."""

from __future__ import annotations

import json

import pytest

from dsamodel.config import ModelConfig
from kvoffload.plan_sizing import Deployment, format_report, plan_report

DSV32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 2048,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "intermediate_size": 18432,
    "n_routed_experts": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
PREFILL = json.dumps(
    {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "SfaRemoteD2HConnector",
                    "kv_role": "kv_producer",
                    "kv_port": 20050,
                    "kv_connector_extra_config": {"transfer_backend": "memfabric"},
                },
                {
                    "kv_connector": "AscendStoreConnector",
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {
                        "backend": "memcache",
                        "use_layerwise": True,
                        "layerwise_num_shared_buffers": 3,
                        "layerwise_independent_layers": [0],
                    },
                },
            ]
        },
    }
)
DECODE = json.dumps(
    {
        "kv_connector": "SfaRemoteD2HConnector",
        "kv_role": "kv_consumer",
        "kv_port": 20050,
        "kv_connector_extra_config": {"transfer_backend": "memfabric", "use_layerwise": True},
    }
)
SPARSE = json.dumps(
    {"sparse_kv_offload_config": {"enabled": True, "topk_buffer_size": 4096, "dram_size_per_dp_GB": 128}}
)


def _deployment(**kw) -> Deployment:
    base = dict(
        config=ModelConfig.from_dict(DSV32),
        block_size=64,
        max_model_len=131072,
        max_num_seqs=8,
        prefill_kv_transfer_config=PREFILL,
        decode_kv_transfer_config=DECODE,
        decode_additional_config=SPARSE,
    )
    base.update(kw)
    return Deployment(**base)


def test_guide_configs_on_deepseek_v32():
    r = plan_report(_deployment())
    assert r["valid"] and r["errors"] == []
    p, d = r["prefill"], r["decode"]
    assert p["num_logical_layers"] == 62 and p["num_buffers"] == 4
    assert p["log_line"] == (
        "Layerwise KV cache reuse merged 124 descriptors into 8 descriptors using 4 buffer assignments."
    )
    tokens = 8 * 131072
    index = 128 + 4  # DeepseekV32ForCausalLM: 128 fp8 key bytes + one float32 scale per 128 elements
    per_layer = tokens * (576 * 2 + index)
    assert p["device_kv_bytes_no_offload"] == 62 * per_layer and p["device_kv_bytes"] == 4 * per_layer
    assert d["device_kv_bytes_no_offload"] == 62 * per_layer
    assert d["device_kv_bytes"] == 8 * 62 * (131072 * index + 4096 * 576 * 2)
    assert d["host_kv_bytes"] == tokens * 62 * 576 * 2
    assert d["control_ports"] == [20050]
    assert "Layerwise KV cache reuse merged" in format_report(r)


def test_the_indexer_is_sized_as_fp8_plus_scale_and_says_why():
    r = plan_report(_deployment())
    ix = r["model"]["indexer"]
    assert (ix["dtype"], ix["key_bytes"], ix["scale_bytes"], ix["scale_dtype"], ix["scale_block"], ix["row_bytes"]) == (
        "float8_e4m3fn",
        128,
        4,
        "float32",
        128,
        132,
    )
    assert r["model"]["indexer_row_bytes"] == 132 and "DeepseekV32ForCausalLM" in ix["source"]
    assert (
        "indexer cache: 132 B/token = 128 B float8_e4m3fn + 4 B float32 scale (one per 128 elements); "
        "architectures DeepseekV32ForCausalLM"
    ) in format_report(r)
    other = plan_report(_deployment(config=ModelConfig.from_dict({**DSV32, "architectures": ["GlmForCausalLM"]})))
    ox = other["model"]["indexer"]
    assert (ox["dtype"], ox["row_bytes"], ox["scale_bytes"], ox["scale_block"]) == ("bfloat16", 256, 0, None)
    assert ox["source"] == "torch_dtype bfloat16 (architectures ['GlmForCausalLM']: no fp8 indexer cache)"
    assert other["prefill"]["device_kv_bytes"] > r["prefill"]["device_kv_bytes"]


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(prefill_additional_config=SPARSE), "never enable sparse_kv_offload_config on prefill"),
        (
            dict(
                decode_additional_config=json.dumps(
                    {"sparse_kv_offload_config": {"enabled": True, "topk_buffer_size": 1024}}
                )
            ),
            "topk_buffer_size",
        ),
        (dict(max_model_len=1 << 20), "dram_size_per_dp_GB"),
        (dict(prefill_tp=2, decode_tp=4), "prefill TP"),
    ],
)
def test_invalid_deployments_are_reported(kw, fragment):
    r = plan_report(_deployment(**kw))
    assert not r["valid"]
    assert any(fragment in e for e in r["errors"]), r["errors"]


def test_nothing_to_size_is_an_error():
    r = plan_report(_deployment(prefill_kv_transfer_config=None, decode_kv_transfer_config=None))
    assert not r["valid"]


def test_cli_json_and_exit_status(tmp_path, capsys):
    from kvoffload.cli import main

    (tmp_path / "config.json").write_text(json.dumps(DSV32))
    rc = main(
        [
            "plan",
            "--model",
            str(tmp_path),
            "--prefill-kv-transfer-config",
            PREFILL,
            "--decode-kv-transfer-config",
            DECODE,
            "--decode-additional-config",
            SPARSE,
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["valid"]
    for key in ("num_logical_layers", "num_buffers", "device_kv_bytes", "device_kv_bytes_no_offload"):
        assert key in out["prefill"]
    for key in ("device_kv_bytes", "device_kv_bytes_no_offload", "host_kv_bytes"):
        assert key in out["decode"]
    rc = main(
        [
            "plan",
            "--model",
            str(tmp_path),
            "--prefill-kv-transfer-config",
            PREFILL,
            "--prefill-additional-config",
            SPARSE,
            "--json",
        ]
    )
    assert rc == 1 and json.loads(capsys.readouterr().out)["errors"]


def test_the_decode_host_pool_is_counted_once_per_dp_rank_whatever_its_tp():
    one = plan_report(_deployment())["decode"]
    for dp, tp in ((1, 4), (2, 2)):
        r = plan_report(_deployment(prefill_tp=4, decode_tp=tp, decode_dp=dp))
        assert r["valid"], r["errors"]
        d = r["decode"]
        assert d["host_pool_bytes"] == one["host_pool_bytes"] and d["host_pool_tp_ranks"] == tp
        assert d["host_pool_bytes_all_dp_ranks"] == dp * one["host_pool_bytes"]  # never x tp
        assert f"per DP rank, one pool its {tp} TP rank(s) share" in format_report(r)


SMOLLM2 = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def test_a_llama_directory_is_planned_with_k_and_v_rows_and_its_indexer(tmp_path, capsys):
    """A Llama model's row is K and V of every KV head (3 x 64 x 2 x 2 bytes), its indexer's keys the
    PCA rank of each head (16 x 3 x 2 bytes), read from the directory without its weights."""
    from kvoffload.cli import main

    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    (tmp_path / "kvoffload-indexer").mkdir()
    (tmp_path / "kvoffload-indexer" / "kvoffload-indexer.json").write_text(
        json.dumps({"method": "pca", "rank": 16, "index_topk": 512})
    )
    (tmp_path / "kvoffload-indexer" / "kvoffload-indexer.safetensors").write_bytes(b"")
    argv = ["plan", "--model", str(tmp_path), "--block-size", "16", "--max-model-len", "8192", "--json"]
    decode = DECODE.replace("memfabric", "kvoffload")
    assert (
        main(
            [*argv, "--decode-kv-transfer-config", decode, "--decode-additional-config", SPARSE.replace("4096", "1024")]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    model = report["model"]
    assert (model["main_row_kind"], model["main_row_bytes"], model["indexer_row_bytes"]) == ("k_v", 768, 96)
    assert model["index_topk"] == 512 and model["num_mtp_layers"] == 0
    # the decode's device KV: hot buffers of 1,024 rows and every row's indexer keys, against every K/V row
    hot_and_keys, dense = 1024 * 768 + 8192 * 96, 8192 * 864  # bytes per layer and sequence slot
    assert report["decode"]["device_kv_ratio"] == pytest.approx(hot_and_keys / dense, abs=1e-4)
