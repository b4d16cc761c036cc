"""The P→D paths ``bench pd`` and ``bench vllm`` measure come from ``kvcore.transferregistry``: each
stack backend's path on one host and across hosts (once each), each vLLM backend's path across hosts;
a new entry adds its path, with no list of the benches' to edit."""

from __future__ import annotations

import pytest

from kvcore.transferregistry import TRANSFERS, PullPath, TransferBackend
from kvoffload_bench import pd_backends
from kvoffload_bench.pd_backends import ACROSS, BACKENDS, OTHER_HOST, READ_COUNTERS, stack_paths
from kvoffload_bench.vllm_backends import BACKENDS as VLLM_BACKENDS


def test_bench_pd_measures_every_stack_path_once() -> None:
    assert BACKENDS == {
        "shared_memory": ({"transfer": "kvoffload"}, "reads_shared_memory"),
        "grpc_stream": ({"transfer": "kvoffload", **OTHER_HOST}, "reads_streamed"),
        "mooncake": ({"transfer": "mooncake"}, "reads_engine"),
    }
    assert ACROSS == {
        "grpc_stream": ({"transfer": "kvoffload", **OTHER_HOST}, "reads_streamed"),
        "mooncake": ({"transfer": "mooncake", **OTHER_HOST}, "reads_engine"),
    }
    assert READ_COUNTERS == ("reads_shared_memory", "reads_streamed", "reads_engine")


def test_bench_vllm_measures_each_backend_vllm_takes_by_its_path_across_hosts() -> None:
    assert VLLM_BACKENDS == {"grpc_stream": ("kvoffload", "reads_streamed"), "mooncake": ("mooncake", "reads_engine")}


def test_a_new_stack_entry_adds_its_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    path = PullPath("nixl", "reads_engine")
    nixl = TransferBackend("nixl", "NIXL", path, path, engine="pdlink.nixl:start_transfer", stack=True)
    monkeypatch.setattr(pd_backends, "TRANSFERS", {**TRANSFERS, "nixl": nixl})
    assert list(stack_paths(one_host=True)) == ["shared_memory", "grpc_stream", "mooncake", "nixl"]
    assert stack_paths(one_host=False)["nixl"] == ({"transfer": "nixl", **OTHER_HOST}, "reads_engine")
