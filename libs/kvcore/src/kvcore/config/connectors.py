"""``kv_connector_extra_config`` of each single connector: ``StoreConnectorConfig`` (the
AscendStoreConnector: host KV pool and layerwise offload) and ``D2HConnectorConfig`` (the
SfaRemoteD2HConnector: remote P→D device-to-host pull), with the keys that belong to one backend
(a host-pool backend's keys are its ``kvcore.pool.registry`` entry's model, in ``kvcore.config.pool_keys``; a
transfer backend's keys are fields here, named by its ``kvcore.transferregistry`` entry).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator

from kvcore.config.errors import Problem
from kvcore.config.fields import (
    StrictBool,
    choice,
    host,
    independent_layers,
    int_rule,
    positive_gib,
    positive_seconds,
)
from kvcore.config.model import ConfigModel
from kvcore.config.names import LAYERWISE_KEYS, MEMFABRIC_DATA_OPS
from kvcore.pool.registry import POOL_BACKENDS, STORE_BACKENDS, key_models
from kvcore.transferregistry import TRANSFER_NAMES, TRANSFERS

POOL_KEY_MODELS = key_models()  # backend name -> the model of its keys


class StoreCommonKeys(ConfigModel):
    """The AscendStoreConnector's keys every backend shares."""

    backend: Annotated[str, choice(STORE_BACKENDS)]
    use_layerwise: StrictBool = False
    layerwise_num_shared_buffers: Annotated[int | None, int_rule(1, optional=True)] = None
    layerwise_independent_layers: Annotated[Literal["all"] | tuple[int, ...], BeforeValidator(independent_layers)] = (
        0,
    )
    layerwise_prefetch_layers: Annotated[int | None, int_rule(1, optional=True)] = None
    # vLLM's store only: GiB the host copies of running requests on shared layer buffers may hold
    # (kvoffload_vllm.request_kv_budget; null: a quarter of the memory available at start-up)
    layerwise_request_kv_gb: Annotated[float | None, BeforeValidator(positive_gib)] = None
    # the host memory this node contributes (the reference prefill also takes --host-pool-gb)
    host_pool_gb: Annotated[float | None, BeforeValidator(positive_gib)] = None


# pydantic lists the fields of the last base first: the common keys, then each backend's in registry
# order. The bases come from the registry, so a type checker cannot see them.
class StoreConnectorConfig(*reversed(POOL_KEY_MODELS.values()), StoreCommonKeys):  # type: ignore[misc]
    """``kv_connector_extra_config`` of an AscendStoreConnector (host KV pool + layerwise offload)."""

    _ROOT: ClassVar[str] = "kv_connector_extra_config"

    @classmethod
    def _raw_problems(cls, data: dict[str, Any]) -> list[Problem]:
        """A backend's required keys, and the keys of other backends it does not tolerate."""
        name = data.get("backend")
        backend = POOL_BACKENDS.get(name) if isinstance(name, str) else None
        if backend is None:
            return []  # the backend itself is reported
        problems: list[Problem] = [
            ((key,), f"required with backend {backend.name!r}; {rule}")
            for key, rule in backend.required.items()
            if data.get(key) is None
        ]
        for owner, model in POOL_KEY_MODELS.items():
            if owner == backend.name:
                continue
            problems += [
                ((key,), f"applies to backend {owner!r} only ({spec.description}), not {backend.name!r}; remove it")
                for key, spec in model.model_fields.items()
                if data.get(key) is not None and key not in backend.tolerates
            ]
        return problems

    def _own_warnings(self) -> list[Problem]:
        if self.use_layerwise:
            return []
        return [
            ((key,), "has no effect while use_layerwise is false (set use_layerwise: true to use it)")
            for key in LAYERWISE_KEYS
            if key in self.model_fields_set
        ]


class D2HConnectorConfig(ConfigModel):
    """``kv_connector_extra_config`` of an SfaRemoteD2HConnector (remote P→D device-to-host pull)."""

    _ROOT: ClassVar[str] = "kv_connector_extra_config"

    transfer_backend: Annotated[str | None, choice(TRANSFER_NAMES, optional=True)] = None
    use_layerwise: StrictBool = False
    # read by the vLLM connector (kvoffload_vllm); the reference services take them as flags
    advertise_host: Annotated[str | None, BeforeValidator(host)] = None  # where peers reach this engine
    data_port: Annotated[int | None, int_rule(0, 65535, optional=True)] = None  # producer's LayerSource; 0: any
    peer_timeout_s: Annotated[float | None, BeforeValidator(positive_seconds)] = None
    kv_digests: StrictBool = False  # decode: log a digest of each layer's prompt KV once it landed
    # transfer_backend "memfabric" only (its registry entry's keys): TransferEngine.initialize's
    # device_id and data_op_type
    memfabric_device_id: Annotated[int, int_rule(0)] = 0
    memfabric_data_op: Annotated[str, choice(MEMFABRIC_DATA_OPS)] = "sdma"

    VLLM_ONLY: ClassVar[dict[str, str | None]] = {  # key -> the kvoffload services' flag (None: none)
        "advertise_host": "--advertise-host",
        "data_port": "--data-port",
        "peer_timeout_s": "--peer-timeout-s",
        "kv_digests": None,
    }

    @classmethod
    def _raw_problems(cls, data: dict[str, Any]) -> list[Problem]:
        """The keys of another transfer backend than the one chosen (each entry names its own keys)."""
        backend = data.get("transfer_backend")
        if not isinstance(backend, str) or backend not in TRANSFERS:
            return []  # a missing or unknown transfer_backend is reported on its own
        return [
            ((key,), f"applies to transfer_backend {owner.name!r} only ({what}), not {backend!r}; remove it")
            for owner in TRANSFERS.values()
            if owner.name != backend
            for key, what in owner.keys.items()
            if key in data
        ]

    def vllm_only_problems(self, prefix: str = "") -> list[str]:
        """The vLLM-connector keys this config sets, as errors naming the reference service's flag."""
        return [
            f"{prefix}kv_connector_extra_config.{key}: read by the vLLM connector only; the kvoffload "
            + (f"services take {flag} instead" if flag else "services have no such option; remove it")
            for key, flag in self.VLLM_ONLY.items()
            if key in self.model_fields_set
        ]
