"""A bfloat16 token's row is the same alone as in a batch (``dsamodel.modules.batch_rows``).

torch's bfloat16 CPU GEMM computes a one-row product with another kernel than a product of two rows
or more and rounds some outputs differently in their last bit. A request decoded alone (a batch of
one, the plain reference's every step) and the same request in a batch of several then parted at a
near tie of the greedy choice: through the P/D stack at 256 clients a request's tokens differed from
the single-process engine's (I3; seen in `kvoffload bench load`, reproduced with two requests).
"""

from __future__ import annotations

import dataclasses

import torch

N = 64  # rows: on this CPU about one in ten differed somewhere before one row was computed as two


def _rows(model, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded hidden states [n, D], positions [n] and latent attention outputs [n, H, R] in bf16."""
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, cfg.hidden_size, generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (n,), generator=gen)
    latent = torch.randn(n, cfg.num_attention_heads, cfg.kv_lora_rank, generator=gen).to(torch.bfloat16)
    return h, positions, latent


def _assert_row(alone, batched, i: int, what: str) -> None:
    assert torch.equal(alone[0], batched[i]), f"{what}: row {i} alone differs from the same row in a batch of {N}"


def test_every_per_token_step_gives_a_row_the_same_bytes_alone_as_in_a_batch(model_bf16):
    model = model_bf16
    h, positions, latent = _rows(model, N, seed=0)
    with torch.inference_mode():
        for layer in model.cache_layers:  # the base layers and the MTP layer
            batched = layer.project(h, positions)
            finished = layer.finish(h, latent)
            for i in range(N):
                alone = layer.project(h[i : i + 1], positions[i : i + 1])
                for f in dataclasses.fields(alone):
                    a, b = getattr(alone, f.name), getattr(batched, f.name)
                    if isinstance(a, torch.Tensor):
                        _assert_row(a, b, i, f"layer {layer.cache_index} project().{f.name}")
                alone_out = layer.finish(h[i : i + 1], latent[i : i + 1])
                _assert_row(alone_out, finished, i, f"layer {layer.cache_index} finish")
        logits, tokens = model.logits(h), torch.arange(N) % model.config.vocab_size
        mtp_in, mtp_logits = model.mtp_input(h, tokens), model.mtp_logits(h)
        for i in range(N):
            _assert_row(model.logits(h[i : i + 1]), logits, i, "logits")
            _assert_row(model.mtp_input(h[i : i + 1], tokens[i : i + 1]), mtp_in, i, "mtp_input")
            _assert_row(model.mtp_logits(h[i : i + 1]), mtp_logits, i, "mtp_logits")


def test_rows_of_batches_of_two_or_more_agree_whatever_the_batch():
    """What one row made two relies on: the rows of a product of 2..N rows equal each other's."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(208, 128, generator=gen).to(torch.bfloat16)
    x = torch.randn(300, 128, generator=gen).to(torch.bfloat16)
    full = torch.nn.functional.linear(x, weight)
    for n in (2, 3, 8, 17, 100):
        assert torch.equal(torch.nn.functional.linear(x[:n], weight), full[:n]), n
