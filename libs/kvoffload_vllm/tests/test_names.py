"""The connector names a user's config may give: the store loads, the one not built yet says so."""

from __future__ import annotations

import pytest

import kvoffload_vllm


def test_a_connector_that_does_not_exist_yet_says_so():
    with pytest.raises(AttributeError, match="SfaRemoteD2HConnector: the remote D2H .* not implemented yet"):
        getattr(kvoffload_vllm, "SfaRemoteD2HConnector")
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        getattr(kvoffload_vllm, "Nope")


def test_the_store_connector_is_a_vllm_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert issubclass(kvoffload_vllm.AscendStoreConnector, KVConnectorBase_V1)
