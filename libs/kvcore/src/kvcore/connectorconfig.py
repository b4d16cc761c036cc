"""``kv_connector_extra_config`` of each single connector: ``StoreConnectorConfig`` (the
AscendStoreConnector: host KV pool and layerwise offload) and ``D2HConnectorConfig`` (the
SfaRemoteD2HConnector: remote P→D device-to-host pull), with the keys that belong to one backend.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BeforeValidator

from kvcore.configerrors import Problem
from kvcore.configfields import (
    StrictBool,
    address,
    choice,
    host,
    independent_layers,
    int_rule,
    namespace,
    positive_gib,
    positive_seconds,
)
from kvcore.configmodel import ConfigModel
from kvcore.confignames import LAYERWISE_KEYS, MEMFABRIC_DATA_OPS, STORE_BACKENDS, TRANSFER_BACKENDS


class StoreConnectorConfig(ConfigModel):
    """``kv_connector_extra_config`` of an AscendStoreConnector (host KV pool + layerwise offload)."""

    _ROOT: ClassVar[str] = "kv_connector_extra_config"

    backend: Annotated[str, choice(STORE_BACKENDS)]
    use_layerwise: StrictBool = False
    layerwise_num_shared_buffers: Annotated[int | None, int_rule(1, optional=True)] = None
    layerwise_independent_layers: Annotated[
        Union[Literal["all"], tuple[int, ...]], BeforeValidator(independent_layers)
    ] = (0,)
    layerwise_prefetch_layers: Annotated[int | None, int_rule(1, optional=True)] = None
    # backend "kvoffload": the metastore indexing the pool (the reference prefill also takes --metastore)
    metastore: Annotated[str | None, address("the kvoffload-metastore's address")] = None
    # every backend: the host memory this node contributes (the reference prefill also takes --host-pool-gb)
    host_pool_gb: Annotated[float | None, BeforeValidator(positive_gib)] = None
    # backend "mooncake": the mooncake_master, the key namespace pools share, the master's lease TTL
    mooncake_master: Annotated[str | None, address("the mooncake_master's RPC address")] = None
    mooncake_namespace: Annotated[str, BeforeValidator(namespace)] = "kvoffload"
    mooncake_lease_ttl_ms: Annotated[int, int_rule(1)] = 5_000  # the master's --default_kv_lease_ttl

    # keys that belong to one backend: key -> (that backend, what it is for); with another backend,
    # giving one is an error. (``metastore`` is refused by "mooncake" only: a memcache config may
    # carry it, as before, and is refused at start-up anyway.)
    BACKEND_KEYS: ClassVar[dict[str, tuple[str, str]]] = {
        "mooncake_master": ("mooncake", "the mooncake backend's master"),
        "mooncake_namespace": ("mooncake", "the mooncake backend's key namespace"),
        "mooncake_lease_ttl_ms": ("mooncake", "the mooncake backend's lease TTL"),
        "metastore": ("kvoffload", "the kvoffload-metastore that indexes the embedded pool; the mooncake backend "
                                   "keeps its index in the mooncake_master"),
    }

    @classmethod
    def _raw_problems(cls, data: dict[str, Any]) -> list[Problem]:
        backend = data.get("backend")
        if backend not in STORE_BACKENDS:
            return []  # the backend itself is reported
        problems: list[Problem] = []
        if backend == "mooncake" and data.get("mooncake_master") is None:
            problems.append((("mooncake_master",), "required with backend 'mooncake'; must be \"HOST:PORT\" (the "
                                                   "mooncake_master's RPC address, e.g. \"127.0.0.1:50051\")"))
        for key, (owner, what) in cls.BACKEND_KEYS.items():
            refused = backend != owner and (owner == "mooncake" or backend == "mooncake")
            if data.get(key) is not None and refused:
                problems.append(((key,), f"applies to backend {owner!r} only ({what}), not {backend!r}; remove it"))
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

    transfer_backend: Annotated[str | None, choice(TRANSFER_BACKENDS, optional=True)] = None
    use_layerwise: StrictBool = False
    # read by the vLLM connector (kvoffload_vllm); the reference services take them as flags
    advertise_host: Annotated[str | None, BeforeValidator(host)] = None  # where peers reach this engine
    data_port: Annotated[int | None, int_rule(0, 65535, optional=True)] = None  # producer's LayerSource; 0: any
    peer_timeout_s: Annotated[float | None, BeforeValidator(positive_seconds)] = None
    # transfer_backend "memfabric" only: TransferEngine.initialize's device_id and data_op_type
    memfabric_device_id: Annotated[int, int_rule(0)] = 0
    memfabric_data_op: Annotated[str, choice(MEMFABRIC_DATA_OPS)] = "sdma"

    VLLM_ONLY: ClassVar[dict[str, str]] = {"advertise_host": "--advertise-host", "data_port": "--data-port",
                                           "peer_timeout_s": "--peer-timeout-s"}
    # keys of transfer_backend "memfabric": key -> what it is (with its default); refused with "kvoffload"
    MEMFABRIC_KEYS: ClassVar[dict[str, str]] = {
        "memfabric_device_id": "the Ascend NPU memfabric's TransferEngine binds; default 0",
        "memfabric_data_op": "memfabric's data operation; default 'sdma'",
    }

    @classmethod
    def _raw_problems(cls, data: dict[str, Any]) -> list[Problem]:
        backend = data.get("transfer_backend")
        if backend == "memfabric" or backend not in TRANSFER_BACKENDS:
            return []  # a missing or unknown transfer_backend is reported on its own
        return [((key,), f"applies to transfer_backend 'memfabric' only ({what}), not {backend!r}; remove it")
                for key, what in cls.MEMFABRIC_KEYS.items() if key in data]

    def vllm_only_problems(self, prefix: str = "") -> list[str]:
        """The vLLM-connector keys this config sets, as errors naming the reference service's flag."""
        return [f"{prefix}kv_connector_extra_config.{key}: read by the vLLM connector only; the kvoffload "
                f"services take {flag} instead" for key, flag in self.VLLM_ONLY.items() if key in self.model_fields_set]
