"""Shared fixtures: the tiny preset in memory (fp32 and bf16) and seeded prompts."""

import pytest
import torch

from dsamodel.presets import tiny_model


@pytest.fixture(scope="session")
def model_fp32():
    return tiny_model(seed=0, dtype="float32")


@pytest.fixture(scope="session")
def model_bf16():
    return tiny_model(seed=0, dtype="float32").to(torch.bfloat16)


@pytest.fixture(scope="session")
def prompt():
    """prompt(num_tokens, seed=1) -> a seeded byte prompt [T]."""

    def make(num_tokens: int, seed: int = 1) -> torch.Tensor:
        return torch.randint(0, 256, (num_tokens,), generator=torch.Generator().manual_seed(seed))

    return make
