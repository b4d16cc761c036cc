"""What the connectors' configs say of parallelism (``d2h_settings``, ``kvoffload_vllm.tp``): tensor
parallel is taken, each decode rank on its own control port; pipeline parallel, and KV heads vLLM
copies to some ranks only, are refused naming the values. A stand-in of vLLM's config carries the
fields they read."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcore.config.errors import ConfigError
from kvoffload_vllm.d2h_settings import d2h_settings
from kvoffload_vllm.tp import kv_heads_copied, kv_replicated


def vllm_config(tp: int = 1, pp: int = 1, dp_rank: int = 0, heads: int = 2, mla: bool = False, role="kv_consumer"):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector="SfaRemoteD2HConnector",
            kv_role=role,
            kv_port=20050 if role == "kv_consumer" else None,
            kv_connector_extra_config={"transfer_backend": "kvoffload"},
        ),
        additional_config={},
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_rank=dp_rank),
        model_config=SimpleNamespace(
            use_mla=mla, get_total_num_kv_heads=lambda: heads, get_num_kv_heads=lambda par: max(1, heads // tp)
        ),
    )


def test_a_tp_decode_rank_0_listens_on_kv_port_plus_dp_rank_times_tp():
    s = d2h_settings(vllm_config(tp=2, dp_rank=1))
    assert (s.control_port, s.base_port, s.tp_size, s.tp_rank, s.kv_heads) == (20052, 20052, 2, 0, 1)
    assert not s.kv_replicated


def test_pipeline_parallel_is_refused_naming_it():
    with pytest.raises(ConfigError, match="pipeline parallel is not supported; got pipeline_parallel_size 2"):
        d2h_settings(vllm_config(pp=2))


def test_kv_heads_copied_to_some_ranks_only_are_refused_naming_both_counts():
    assert kv_heads_copied(vllm_config(tp=4, heads=2)) == 2
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 over 2 KV heads: vLLM copies each head to 2 ranks"):
        d2h_settings(vllm_config(tp=4, heads=2, role="kv_producer"))


def test_every_rank_holds_the_same_kv_for_mla_and_for_one_kv_head():
    assert kv_replicated(vllm_config(tp=2, mla=True)) and kv_replicated(vllm_config(tp=4, heads=1))
    assert not kv_replicated(vllm_config(tp=2, heads=2)) and kv_heads_copied(vllm_config(tp=2, mla=True)) == 1
