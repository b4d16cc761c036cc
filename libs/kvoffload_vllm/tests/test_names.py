"""The connector names a user's config may give: both load as vLLM connectors, others are named."""

from __future__ import annotations

import pytest

import kvoffload_vllm


def test_an_unknown_name_is_named():
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        getattr(kvoffload_vllm, "Nope")  # noqa: B009 - the module's __getattr__ is the subject, not an attribute


@pytest.mark.parametrize("name", kvoffload_vllm.__all__)
def test_each_connector_is_a_vllm_connector(name):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert issubclass(getattr(kvoffload_vllm, name), KVConnectorBase_V1)
