"""Each host-pool backend's keys in the store connector's ``kv_connector_extra_config``, as the typed
model that validates them (named by the backend's ``kvcore.pool.registry`` entry).

``kvcore.config.connectors.StoreConnectorConfig`` holds every backend's keys next to the common ones;
with another backend, giving one is an error that says what the key is for (its field's
``description``), unless that backend tolerates it (``PoolBackend.tolerates``).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

from kvcore.config.fields import address, int_rule, namespace
from kvcore.config.model import ConfigModel


class EmbeddedPoolKeys(ConfigModel):
    """Backend "kvoffload": the metastore indexing the pool (the reference prefill also takes --metastore)."""

    metastore: Annotated[
        str | None,
        address("the kvoffload-metastore's address"),
        Field(
            description="the kvoffload-metastore that indexes the embedded pool; the mooncake backend keeps its index "
            "in the mooncake_master"
        ),
    ] = None


class MooncakePoolKeys(ConfigModel):
    """Backend "mooncake": the mooncake_master, the key namespace pools share, the master's lease TTL."""

    mooncake_master: Annotated[
        str | None, address("the mooncake_master's RPC address"), Field(description="the mooncake backend's master")
    ] = None
    mooncake_namespace: Annotated[
        str, BeforeValidator(namespace), Field(description="the mooncake backend's key namespace")
    ] = "kvoffload"
    # the master's --default_kv_lease_ttl
    mooncake_lease_ttl_ms: Annotated[int, int_rule(1), Field(description="the mooncake backend's lease TTL")] = 5_000
