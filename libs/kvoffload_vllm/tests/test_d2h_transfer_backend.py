"""The transfer backends the D2H connector takes inside vLLM are the ``kvcore.transferregistry``
entries without a ``vllm_refusal``: one it does not take is refused naming why and the ones it takes;
an unknown one is refused listing the registry's names; with none the pull runs on the embedded
path. A stand-in of vLLM's config carries the fields ``d2h_settings`` reads."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from kvcore.config.errors import ConfigError
from kvcore.transferregistry import TRANSFERS, VLLM_TRANSFERS
from kvoffload_vllm import d2h_settings as settings_module
from kvoffload_vllm.d2h_settings import d2h_settings, vllm_refusal


def vllm_config(**extra: object) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector="SfaRemoteD2HConnector",
            kv_role="kv_consumer",
            kv_port=20050,
            kv_connector_extra_config=extra,
        ),
        additional_config={},
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0),
        model_config=SimpleNamespace(use_mla=False, get_total_num_kv_heads=lambda: 2, get_num_kv_heads=lambda par: 2),
    )


@pytest.mark.parametrize("name", VLLM_TRANSFERS)
def test_each_backend_vllm_takes_is_its_settings_backend(name: str) -> None:
    assert vllm_refusal(name) == ""
    assert d2h_settings(vllm_config(transfer_backend=name)).transfer_backend == name


def test_without_a_backend_the_pull_runs_on_the_embedded_path() -> None:
    assert d2h_settings(vllm_config()).transfer_backend == "kvoffload"


def test_a_backend_vllm_does_not_take_is_refused_naming_why_and_the_ones_it_takes() -> None:
    with pytest.raises(ConfigError) as info:
        d2h_settings(vllm_config(transfer_backend="memfabric"))
    assert info.value.errors == [
        "kv_connector_extra_config.transfer_backend: got 'memfabric'; inside vLLM the pull runs on 'kvoffload' or "
        "'mooncake' (memfabric is a path of the kvoffload services only, for now)"
    ]


def test_the_refusal_is_the_registry_entrys(monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry's ``vllm_refusal`` alone decides: a backend given one is refused with its words."""
    refused = dataclasses.replace(TRANSFERS["mooncake"], vllm_refusal="not on vLLM yet")
    monkeypatch.setattr(settings_module, "TRANSFERS", {**TRANSFERS, "mooncake": refused})
    assert vllm_refusal("mooncake").endswith(
        "got 'mooncake'; inside vLLM the pull runs on 'kvoffload' (not on vLLM yet)"
    )


def test_an_unknown_backend_is_refused_listing_the_registrys_names() -> None:
    with pytest.raises(
        ConfigError, match="transfer_backend: got 'nixl' \\(str\\); must be one of 'kvoffload', 'memfabric', 'mooncake'"
    ):
        d2h_settings(vllm_config(transfer_backend="nixl"))
