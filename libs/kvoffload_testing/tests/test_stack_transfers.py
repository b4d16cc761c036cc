"""A loopback stack runs the transfer backends whose ``kvcore.transferregistry`` entry says so
(``STACK_TRANSFERS``); any other is refused naming the field and those it runs, and the vLLM stack
refuses one the vLLM connectors do not take, before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcore.transferregistry import STACK_TRANSFERS
from kvoffload_testing import vllm_stack
from kvoffload_testing.stack_config import StackConfig
from kvoffload_testing.vllm_stack import VllmStack


def _cfg(tmp_path: Path, **kw) -> StackConfig:
    return StackConfig(model=tmp_path / "model", log_dir=tmp_path / "logs", **kw)


def test_the_stack_runs_the_embedded_path_unless_told_otherwise(tmp_path: Path) -> None:
    assert _cfg(tmp_path).transfer == "kvoffload"
    assert [_cfg(tmp_path, transfer=name).transfer for name in STACK_TRANSFERS] == ["kvoffload", "mooncake"]


@pytest.mark.parametrize("name", ["memfabric", "nixl"])
def test_a_backend_the_stack_does_not_run_is_refused_naming_the_ones_it_runs(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=f"^transfer: got '{name}'; must be one of 'kvoffload', 'mooncake'$"):
        _cfg(tmp_path, transfer=name)


def test_the_vllm_stack_refuses_a_backend_the_vllm_connectors_do_not_take(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_stack, "VLLM_TRANSFERS", ("kvoffload",))
    with pytest.raises(ValueError, match="^transfer: got 'mooncake'; the vLLM connectors take 'kvoffload'$"):
        VllmStack(_cfg(tmp_path, transfer="mooncake"))
