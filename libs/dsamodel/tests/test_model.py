"""Per-layer steps: Projection shapes, cache rows, layer order, MTP pieces, input errors."""

import pytest
import torch

from dsamodel.model import MTPLayer


def test_project_shapes_and_cache_rows(model_bf16, prompt):
    cfg = model_bf16.config
    h = model_bf16.embed(prompt(10))
    positions = torch.arange(100, 110)
    proj = model_bf16.layers[0].project(h, positions)
    assert proj.num_tokens == 10
    assert proj.q_latent.shape == (10, cfg.num_attention_heads, cfg.kv_lora_rank)
    assert proj.q_rope.shape == (10, cfg.num_attention_heads, cfg.qk_rope_head_dim)
    assert proj.kv.shape == (10, cfg.kv_row_width)
    assert proj.index_q.shape == (10, cfg.index_n_heads, cfg.index_head_dim)
    assert proj.index_w.shape == (10, cfg.index_n_heads) and proj.index_w.dtype == torch.float32
    assert proj.index_k.shape == (10, cfg.index_head_dim)
    assert proj.kv.dtype == proj.index_k.dtype == proj.q_latent.dtype == torch.bfloat16
    # a token's cache rows depend on that token and its position only
    alone = model_bf16.layers[0].project(h[3:4], positions[3:4])
    torch.testing.assert_close(alone.kv, proj.kv[3:4])
    moved = model_bf16.layers[0].project(h[3:4], positions[3:4] + 1)
    assert not torch.equal(moved.kv[:, cfg.kv_lora_rank :], alone.kv[:, cfg.kv_lora_rank :])  # k_pe rotates
    assert torch.equal(moved.kv[:, : cfg.kv_lora_rank], alone.kv[:, : cfg.kv_lora_rank])  # c_kv does not


def test_finish_shape(model_fp32, prompt):
    cfg = model_fp32.config
    h = model_fp32.embed(prompt(5))
    out = model_fp32.layers[1].finish(h, torch.zeros(5, cfg.num_attention_heads, cfg.kv_lora_rank))
    assert out.shape == h.shape and out.dtype == h.dtype
    with pytest.raises(ValueError, match="attn_latent"):
        model_fp32.layers[1].finish(h, torch.zeros(5, cfg.num_attention_heads, cfg.kv_lora_rank + 1))


def test_layer_order_and_mtp(model_fp32, prompt):
    cfg = model_fp32.config
    assert [layer.cache_index for layer in model_fp32.cache_layers] == list(range(cfg.num_cache_layers))
    assert len(model_fp32.layers) == 4 and len(model_fp32.mtp) == 1 and isinstance(model_fp32.mtp[0], MTPLayer)
    assert not any(p.requires_grad for p in model_fp32.parameters())
    tokens = prompt(6)
    h_prev = model_fp32.final_norm(model_fp32.embed(tokens))
    x = model_fp32.mtp_input(h_prev, tokens, depth=0)
    assert x.shape == (6, cfg.hidden_size)
    assert model_fp32.mtp_logits(x).shape == (6, cfg.vocab_size)
    assert model_fp32.logits(x).dtype == torch.float32
    with pytest.raises(ValueError, match="MTP depth 1"):
        model_fp32.mtp_input(h_prev, tokens, depth=1)
    with pytest.raises(ValueError, match="disagree"):
        model_fp32.mtp_input(h_prev[:2], tokens, depth=0)


def test_input_errors(model_fp32, model_bf16):
    cfg = model_fp32.config
    layer = model_fp32.layers[0]
    h = torch.zeros(3, cfg.hidden_size)
    with pytest.raises(ValueError, match="max_position_embeddings=32768"):
        layer.project(h, torch.tensor([0, 1, 32768]))
    with pytest.raises(ValueError, match="positions must be in"):
        layer.project(h, torch.tensor([-1, 0, 1]))
    with pytest.raises(ValueError, match="T = 3"):
        layer.project(h, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="integer"):
        layer.project(h, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="bfloat16"):
        model_bf16.layers[0].project(h, torch.arange(3))
    with pytest.raises(ValueError, match=r"\[T, 128\]"):
        layer.project(torch.zeros(3, 7), torch.arange(3))
    with pytest.raises(ValueError, match="token ids"):
        model_fp32.embed(torch.tensor([0, 264]))
    with pytest.raises(ValueError, match="integer"):
        model_fp32.embed(torch.zeros(3))
