"""Validated settings of a prefill (kv_producer) node: ``prefill_settings`` -> ``PrefillSettings``.

The rules that need the node's role and the model (``KVLayout``): a prefill needs an
AscendStoreConnector (alone or inside a MultiConnector), never enables sparse offload, and gets
its shared-buffer defaults and its independent layers (MTP included) resolved against the
model's physical layers. Every problem found is raised together in one ``ConfigError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvcore.config.additional import SparseKVOffloadConfig
from kvcore.config.connectors import D2HConnectorConfig, StoreConnectorConfig
from kvcore.config.errors import ConfigError, describe_value
from kvcore.config.kv_transfer import KVTransferConfig
from kvcore.config.names import SPARSE_KEY, STORE_CONNECTOR
from kvcore.config.node import (
    AdditionalInput,
    KVConfigInput,
    check_positive,
    d2h_of,
    debug_warnings,
    is_int,
    missing_transfer_backend,
    parse_both,
    store_of,
)
from kvcore.layout import KVLayout

DEFAULT_MAX_PREFETCH = 8

IndependentSpec = Literal["all"] | list[int] | tuple[int, ...]


def resolve_independent_layers(
    spec: IndependentSpec, num_layers: int, *, field: str = "layerwise_independent_layers"
) -> frozenset[int]:
    """Physical indices of the independent layers.

    ``"all"`` -> every layer; negative indices count from the end of the physical layers, MTP layers
    included (-1 = last MTP layer); anything outside [-N, N-1] is an error naming the value.
    """
    if not is_int(num_layers) or num_layers < 1:
        raise ConfigError([f"num_layers: got {describe_value(num_layers)}; must be an int >= 1"])
    if spec == "all":
        return frozenset(range(num_layers))
    if not isinstance(spec, (list, tuple)) or not all(is_int(v) for v in spec):
        raise ConfigError([f'{field}: got {describe_value(spec)}; must be "all" or a list of ints'])
    bad = [v for v in spec if not -num_layers <= v < num_layers]
    if bad:
        raise ConfigError(
            [
                f"{field}: got {v}; must be in [-{num_layers}, {num_layers - 1}] "
                f"({num_layers} physical layers, MTP layers included)"
                for v in bad
            ]
        )
    return frozenset(v % num_layers for v in spec)


@dataclass(frozen=True)
class PrefillSettings:
    """Validated settings of a prefill (kv_producer) node."""

    store: StoreConnectorConfig
    d2h: D2HConnectorConfig | None
    num_shared_buffers: int
    independent_layers: frozenset[int]
    prefetch_layers: int
    tp: int
    warnings: list[str] = field(default_factory=list)


def _prefill_connector_errors(kv: KVTransferConfig) -> list[str]:
    errors: list[str] = []
    if not kv.is_producer:
        errors.append(f"kv_role: got {kv.kv_role!r}; a prefill node must be 'kv_producer' (or 'kv_both')")
    if store_of(kv) is None:
        errors.append(
            f"kv_connector: got {kv.kv_connector!r}; a prefill node needs an {STORE_CONNECTOR} "
            "(alone or inside a MultiConnector)"
        )
    d2h = d2h_of(kv)
    if d2h is not None and d2h[2].transfer_backend is None:
        errors.append(missing_transfer_backend(d2h[0]))
    return errors


def _layerwise_errors(prefix: str, store: StoreConnectorConfig) -> list[str]:
    if store.layerwise_num_shared_buffers is None or store.use_layerwise:
        return []
    return [
        f"{prefix}kv_connector_extra_config.layerwise_num_shared_buffers: got "
        f"{store.layerwise_num_shared_buffers} while use_layerwise is false; shared buffers need use_layerwise: true"
    ]


def _vllm_only_warnings(found: tuple[str, StoreConnectorConfig] | None) -> list[str]:
    """The store keys only vLLM's connector reads: the reference prefill keeps a request's earlier
    chunks in the host pool (``host_pool_gb``), not in host copies of their own."""
    if found is None or found[1].layerwise_request_kv_gb is None:
        return []
    return [
        f"{found[0]}kv_connector_extra_config.layerwise_request_kv_gb: has no effect on the reference prefill "
        "(vLLM's store connector bounds its host copies with it; here earlier chunks live in the host pool, "
        "host_pool_gb)"
    ]


def _sparse_on_prefill_errors(sparse: SparseKVOffloadConfig) -> list[str]:
    if sparse.enabled and not sparse.keep_device_kv_cache:
        return [
            f"{SPARSE_KEY}.enabled: got True on a prefill (kv_producer) node; never enable "
            f"{SPARSE_KEY} on prefill (only keep_device_kv_cache: true, a debug mode, allows it)"
        ]
    return []


def prefill_settings(
    kv_transfer_config: KVConfigInput,
    additional_config: AdditionalInput,
    layout: KVLayout,
    *,
    tp: int = 1,
) -> PrefillSettings:
    """Settings of a prefill node; ConfigError lists every violated rule."""
    kv, additional = parse_both(kv_transfer_config, additional_config)
    sparse = additional.sparse_kv_offload_config
    errors = _prefill_connector_errors(kv) + _sparse_on_prefill_errors(sparse)
    check_positive(errors, tp=tp)
    found = store_of(kv)
    independent: frozenset[int] = frozenset()
    if found is not None:
        prefix, store = found
        errors += _layerwise_errors(prefix, store)
        path = f"{prefix}kv_connector_extra_config.layerwise_independent_layers"
        try:
            independent = resolve_independent_layers(store.layerwise_independent_layers, layout.num_layers, field=path)
        except ConfigError as exc:
            errors.extend(exc.errors)
    if errors or found is None:
        raise ConfigError(errors)
    store = found[1]
    buffers = store.layerwise_num_shared_buffers or layout.num_layers
    d2h = d2h_of(kv)
    return PrefillSettings(
        store=store,
        d2h=d2h[2] if d2h else None,
        num_shared_buffers=buffers,
        independent_layers=independent,
        prefetch_layers=store.layerwise_prefetch_layers or min(buffers, DEFAULT_MAX_PREFETCH),
        tp=tp,
        warnings=kv.warnings + additional.warnings + debug_warnings(sparse) + _vllm_only_warnings(found),
    )
