"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest

from kvoffload_testing.stack_config import ensure_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny seeded reference model, written once per test module."""
    return ensure_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
