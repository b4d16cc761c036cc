"""Per-node validated settings: parsed configs combined with the model layout and parallel sizes.

``kvcore.config`` checks each JSON document on its own; this module applies the rules that need
the node's role, the model (``KVLayout``, ``index_topk``) and the parallel sizes: which connector a
prefill or decode node needs, buffer defaults, independent-layer resolution (MTP included), decode
control ports, top-k buffer and host-pool sizing, and P/D pair compatibility. Every problem found
is raised together in one ``ConfigError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from kvcore.config import (
    D2H_CONNECTOR,
    STORE_CONNECTOR,
    AdditionalConfig,
    ConfigError,
    D2HConnectorConfig,
    KVTransferConfig,
    SparseKVOffloadConfig,
    StoreConnectorConfig,
    describe_value,
    parse_additional_config,
    parse_kv_transfer_config,
)
from kvcore.layout import KVLayout

MAX_PORT = 65535
DEFAULT_MAX_PREFETCH = 8
SPARSE = "sparse_kv_offload_config"

IndependentSpec = Union[Literal["all"], list[int], tuple[int, ...]]
KVConfigInput = Union[str, dict[str, Any], KVTransferConfig]
AdditionalInput = Union[str, dict[str, Any], AdditionalConfig, None]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive(errors: list[str], **sizes: Any) -> None:
    for name, value in sizes.items():
        if not _is_int(value) or value < 1:
            errors.append(f"{name}: got {describe_value(value)}; must be an int >= 1")


def _parse_both(kv: KVConfigInput, additional: AdditionalInput) -> tuple[KVTransferConfig, AdditionalConfig]:
    """Both configs parsed (parsed objects pass through); ConfigError lists the problems of both."""
    errors: list[str] = []
    kv_config = additional_config = None
    try:
        kv_config = kv if isinstance(kv, KVTransferConfig) else parse_kv_transfer_config(kv)
    except ConfigError as exc:
        errors.extend(exc.errors)
    try:
        additional_config = (
            additional if isinstance(additional, AdditionalConfig) else parse_additional_config(additional)
        )
    except ConfigError as exc:
        errors.extend(exc.errors)
    if errors or kv_config is None or additional_config is None:
        raise ConfigError(errors)
    return kv_config, additional_config


def _store_of(kv: KVTransferConfig) -> tuple[str, StoreConnectorConfig] | None:
    """(path prefix, extra config) of the AscendStoreConnector, self or child."""
    found = kv.locate(STORE_CONNECTOR)
    if found is None or not isinstance(found[1].kv_connector_extra_config, StoreConnectorConfig):
        return None
    return found[0], found[1].kv_connector_extra_config


def _d2h_of(kv: KVTransferConfig) -> tuple[str, KVTransferConfig, D2HConnectorConfig] | None:
    """(path prefix, connector config, extra config) of the SfaRemoteD2HConnector, self or child."""
    found = kv.locate(D2H_CONNECTOR)
    if found is None or not isinstance(found[1].kv_connector_extra_config, D2HConnectorConfig):
        return None
    return found[0], found[1], found[1].kv_connector_extra_config


def resolve_independent_layers(
    spec: IndependentSpec, num_layers: int, *, field: str = "layerwise_independent_layers"
) -> frozenset[int]:
    """Physical indices of the independent layers.

    ``"all"`` -> every layer; negative indices count from the end of the physical layers, MTP layers
    included (-1 = last MTP layer); anything outside [-N, N-1] is an error naming the value.
    """
    if not _is_int(num_layers) or num_layers < 1:
        raise ConfigError([f"num_layers: got {describe_value(num_layers)}; must be an int >= 1"])
    if spec == "all":
        return frozenset(range(num_layers))
    if not isinstance(spec, (list, tuple)) or not all(_is_int(v) for v in spec):
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
    if _store_of(kv) is None:
        errors.append(
            f"kv_connector: got {kv.kv_connector!r}; a prefill node needs an {STORE_CONNECTOR} "
            "(alone or inside a MultiConnector)"
        )
    d2h = _d2h_of(kv)
    if d2h is not None and d2h[2].transfer_backend is None:
        errors.append(
            f"{d2h[0]}kv_connector_extra_config.transfer_backend: required for {D2H_CONNECTOR}; "
            "must be 'kvoffload' or 'memfabric'"
        )
    return errors


def _layerwise_errors(prefix: str, store: StoreConnectorConfig) -> list[str]:
    if store.layerwise_num_shared_buffers is None or store.use_layerwise:
        return []
    return [
        f"{prefix}kv_connector_extra_config.layerwise_num_shared_buffers: got "
        f"{store.layerwise_num_shared_buffers} while use_layerwise is false; shared buffers need use_layerwise: true"
    ]


def _sparse_on_prefill_errors(sparse: SparseKVOffloadConfig) -> list[str]:
    if sparse.enabled and not sparse.keep_device_kv_cache:
        return [
            f"{SPARSE}.enabled: got True on a prefill (kv_producer) node; never enable "
            f"{SPARSE} on prefill (only keep_device_kv_cache: true, a debug mode, allows it)"
        ]
    return []


def _debug_warnings(sparse: SparseKVOffloadConfig) -> list[str]:
    if sparse.keep_device_kv_cache:
        return [f"{SPARSE}.keep_device_kv_cache: true keeps the full KV cache on the device (debug only)"]
    return []


def prefill_settings(
    kv_transfer_config: KVConfigInput,
    additional_config: AdditionalInput,
    layout: KVLayout,
    *,
    tp: int = 1,
) -> PrefillSettings:
    """Settings of a prefill node; ConfigError lists every violated rule."""
    kv, additional = _parse_both(kv_transfer_config, additional_config)
    sparse = additional.sparse_kv_offload_config
    errors = _prefill_connector_errors(kv) + _sparse_on_prefill_errors(sparse)
    _check_positive(errors, tp=tp)
    found = _store_of(kv)
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
    d2h = _d2h_of(kv)
    return PrefillSettings(
        store=store,
        d2h=d2h[2] if d2h else None,
        num_shared_buffers=buffers,
        independent_layers=independent,
        prefetch_layers=store.layerwise_prefetch_layers or min(buffers, DEFAULT_MAX_PREFETCH),
        tp=tp,
        warnings=kv.warnings + additional.warnings + _debug_warnings(sparse),
    )


@dataclass(frozen=True)
class DecodeSettings:
    """Validated settings of a decode (kv_consumer) node."""

    d2h: D2HConnectorConfig
    sparse: SparseKVOffloadConfig
    kv_port: int
    dp: int
    tp: int
    host_pool_bytes: int
    host_bytes_needed: int
    warnings: list[str] = field(default_factory=list)

    def control_port(self, dp_rank: int, tp_rank: int) -> int:
        """The control port rank (dp_rank, tp_rank) binds: ``kv_port + dp_rank*tp + tp_rank``."""
        if not _is_int(dp_rank) or not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank: got {describe_value(dp_rank)}; must be an int in 0..{self.dp - 1}")
        if not _is_int(tp_rank) or not 0 <= tp_rank < self.tp:
            raise ValueError(f"tp_rank: got {describe_value(tp_rank)}; must be an int in 0..{self.tp - 1}")
        return self.kv_port + dp_rank * self.tp + tp_rank

    def control_ports(self) -> list[int]:
        """Every control port of this decode deployment (dp*tp consecutive ports from kv_port)."""
        return [self.control_port(d, t) for d in range(self.dp) for t in range(self.tp)]


def _decode_connector_errors(kv: KVTransferConfig, dp: int, tp: int) -> list[str]:
    errors: list[str] = []
    if not kv.is_consumer:
        errors.append(f"kv_role: got {kv.kv_role!r}; a decode node must be 'kv_consumer' (or 'kv_both')")
    found = _d2h_of(kv)
    if found is None:
        errors.append(
            f"kv_connector: got {kv.kv_connector!r}; a decode node needs an {D2H_CONNECTOR} "
            "(alone or inside a MultiConnector)"
        )
        return errors
    prefix, node, extra = found
    if extra.transfer_backend is None:
        errors.append(
            f"{prefix}kv_connector_extra_config.transfer_backend: required for {D2H_CONNECTOR}; "
            "must be 'kvoffload' or 'memfabric'"
        )
    if node.kv_port is None:
        errors.append(
            f"{prefix}kv_port: required on decode; the base of dp*tp consecutive control ports (int in 1..65535)"
        )
    elif _is_int(dp) and _is_int(tp) and dp >= 1 and tp >= 1 and node.kv_port + dp * tp - 1 > MAX_PORT:
        last = node.kv_port + dp * tp - 1
        errors.append(
            f"{prefix}kv_port: got {node.kv_port}; dp={dp} x tp={tp} = {dp * tp} control ports need "
            f"{node.kv_port}..{last}, but the last port must be <= {MAX_PORT} (use kv_port <= {MAX_PORT - dp * tp + 1})"
        )
    return errors


def _sparse_decode_errors(sparse: SparseKVOffloadConfig, index_topk: int | None, block_size: int) -> list[str]:
    if not sparse.enabled:
        if sparse.keep_device_kv_cache:
            return []
        return [
            f"{SPARSE}.enabled: got False on a decode (kv_consumer) node; must be true "
            "(or keep_device_kv_cache: true, a debug mode)"
        ]
    if index_topk is None:
        return [
            f"{SPARSE}.enabled: got True but the model has no indexer (index_topk is None); "
            "sparse offload needs a sparse-attention model"
        ]
    if not _is_int(index_topk) or index_topk < 1:
        return [f"index_topk: got {describe_value(index_topk)}; must be an int >= 1 or None"]
    errors = []
    size = sparse.topk_buffer_size
    if size < index_topk:
        errors.append(
            f"{SPARSE}.topk_buffer_size: got {size}; must be >= index_topk {index_topk} "
            f"(2x index_topk = {2 * index_topk} is a good start)"
        )
    if size % block_size:
        errors.append(
            f"{SPARSE}.topk_buffer_size: got {size}; must be divisible by block_size {block_size} "
            f"({size} % {block_size} = {size % block_size})"
        )
    return errors


def host_bytes_needed(layout: KVLayout, *, max_num_seqs: int, max_model_len: int) -> int:
    """Host-pool bytes holding the full main KV of max_num_seqs sequences of max_model_len tokens."""
    tokens = math.ceil(max_model_len / layout.block_size) * layout.block_size
    return max_num_seqs * tokens * layout.main_bytes_per_token


def _host_pool_errors(
    sparse: SparseKVOffloadConfig, needed: int, layout: KVLayout, seqs: int, length: int
) -> list[str]:
    given = sparse.dram_size_per_dp_GB * 2**30
    if needed <= given:
        return []
    tokens = math.ceil(length / layout.block_size) * layout.block_size
    return [
        f"{SPARSE}.dram_size_per_dp_GB: got {sparse.dram_size_per_dp_GB} ({given} bytes); the host pool must hold "
        f"max_num_seqs {seqs} x {tokens} tokens (max_model_len {length} rounded up to block_size "
        f"{layout.block_size}) x {layout.main_bytes_per_token} bytes/token = {needed} bytes; "
        f"needs dram_size_per_dp_GB >= {math.ceil(needed / 2**30)}"
    ]


def decode_settings(
    kv_transfer_config: KVConfigInput,
    additional_config: AdditionalInput,
    layout: KVLayout,
    *,
    index_topk: int | None,
    max_num_seqs: int,
    max_model_len: int,
    dp: int = 1,
    tp: int = 1,
) -> DecodeSettings:
    """Settings of a decode node; ConfigError lists every violated rule."""
    kv, additional = _parse_both(kv_transfer_config, additional_config)
    sparse = additional.sparse_kv_offload_config
    errors: list[str] = []
    _check_positive(errors, max_num_seqs=max_num_seqs, max_model_len=max_model_len, dp=dp, tp=tp)
    errors += _decode_connector_errors(kv, dp, tp)
    errors += _sparse_decode_errors(sparse, index_topk, layout.block_size)
    needed = 0
    if _is_int(max_num_seqs) and _is_int(max_model_len) and max_num_seqs >= 1 and max_model_len >= 1:
        needed = host_bytes_needed(layout, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        errors += _host_pool_errors(sparse, needed, layout, max_num_seqs, max_model_len)
    found = _d2h_of(kv)
    if errors or found is None or found[1].kv_port is None:
        raise ConfigError(errors)
    return DecodeSettings(
        d2h=found[2],
        sparse=sparse,
        kv_port=found[1].kv_port,
        dp=dp,
        tp=tp,
        host_pool_bytes=sparse.dram_size_per_dp_GB * 2**30,
        host_bytes_needed=needed,
        warnings=kv.warnings + additional.warnings + _debug_warnings(sparse),
    )


def check_pd_pair(prefill: PrefillSettings, decode: DecodeSettings) -> None:
    """A prefill and a decode deployment can work together (TP ratio, same P→D transfer backend)."""
    errors: list[str] = []
    problem = tp_pair_problem(prefill.tp, decode.tp)
    if problem:
        errors.append(problem)
    p_backend = prefill.d2h.transfer_backend if prefill.d2h else None
    d_backend = decode.d2h.transfer_backend
    if prefill.d2h is None:
        errors.append(f"prefill kv_connector: no {D2H_CONNECTOR}; both sides need one for the P→D remote D2H pull")
    elif p_backend is None:
        errors.append("prefill kv_connector_extra_config.transfer_backend: not set; must be set on both sides")
    if d_backend is None:
        errors.append("decode kv_connector_extra_config.transfer_backend: not set; must be set on both sides")
    if p_backend is not None and d_backend is not None and p_backend != d_backend:
        errors.append(
            f"transfer_backend: prefill {p_backend!r} != decode {d_backend!r}; "
            "both sides must use the same transfer_backend"
        )
    if errors:
        raise ConfigError(errors)


def _shown(value: Any) -> str:
    return str(value) if _is_int(value) else describe_value(value)


def tp_pair_problem(prefill_tp: int, decode_tp: int) -> str:
    """"" when ``prefill_tp`` prefill ranks can feed ``decode_tp`` decode ranks (prefill TP >= decode
    TP and divisible by it), else why, naming both values."""
    if not (_is_int(prefill_tp) and _is_int(decode_tp)) or prefill_tp < 1 or decode_tp < 1 \
            or prefill_tp < decode_tp or prefill_tp % decode_tp:
        return (f"tp: prefill tp {_shown(prefill_tp)}, decode tp {_shown(decode_tp)}; "
                "prefill TP must be >= decode TP and divisible by it")
    return ""


def tp_handshake_problem(prefill_tp_size: int, prefill_tp_rank: int, decode_tp_size: int, decode_tp_rank: int) -> str:
    """"" when prefill TP rank ``prefill_tp_rank`` (of ``prefill_tp_size``) is a contributor of decode TP
    rank ``decode_tp_rank`` (of ``decode_tp_size``), else why, naming the values of both sides: the
    check both ends of a layout exchange make."""
    problem = tp_pair_problem(prefill_tp_size, decode_tp_size)
    if problem:
        return problem
    if not _is_int(prefill_tp_rank) or not 0 <= prefill_tp_rank < prefill_tp_size:
        return f"prefill_tp_rank: {_shown(prefill_tp_rank)} is outside 0..{prefill_tp_size - 1} (prefill tp {prefill_tp_size})"
    if not _is_int(decode_tp_rank) or not 0 <= decode_tp_rank < decode_tp_size:
        return f"decode_tp_rank: {_shown(decode_tp_rank)} is outside 0..{decode_tp_size - 1} (decode tp {decode_tp_size})"
    target = prefill_tp_rank // (prefill_tp_size // decode_tp_size)
    if target != decode_tp_rank:
        return (f"tp rank: prefill tp rank {prefill_tp_rank} of {prefill_tp_size} feeds decode tp rank {target} "
                f"of {decode_tp_size}, not decode tp rank {decode_tp_rank}")
    return ""


def tp_contributors(prefill_tp: int, decode_tp: int, decode_tp_rank: int) -> list[int]:
    """Prefill TP ranks that feed decode TP rank ``decode_tp_rank``.

    With ``ratio = prefill_tp / decode_tp`` (prefill TP >= decode TP and divisible), decode rank r
    pulls from prefill ranks ``[r * ratio, (r + 1) * ratio)``; its part of a request is complete
    only when all of them reported. MLA KV is replicated across TP, so every contributor holds the
    same rows; each sends its share of every layer (``contributor_share``), so no row crosses twice.
    """
    problem = tp_pair_problem(prefill_tp, decode_tp)
    if problem:
        raise ValueError(problem)
    if not 0 <= decode_tp_rank < decode_tp:
        raise ValueError(f"decode_tp_rank {decode_tp_rank} outside 0..{decode_tp - 1}")
    ratio = prefill_tp // decode_tp
    return list(range(decode_tp_rank * ratio, (decode_tp_rank + 1) * ratio))


def contributor_share(start: int, end: int, index: int, count: int) -> tuple[int, int]:
    """The rows of ``[start, end)`` the ``index``-th of ``count`` contributors sends: consecutive,
    as even as the rows allow (the first ones one row shorter); the shares partition the range."""
    if not 0 <= index < count:
        raise ValueError(f"contributor {index} outside 0..{count - 1}")
    if end < start:
        raise ValueError(f"rows [{start}, {end}) are not a range")
    n = end - start
    return start + index * n // count, start + (index + 1) * n // count


def tp_target(prefill_tp: int, decode_tp: int, prefill_tp_rank: int) -> int:
    """The decode TP rank a prefill TP rank sends to (the inverse of ``tp_contributors``)."""
    if not 0 <= prefill_tp_rank < prefill_tp:
        raise ValueError(f"prefill_tp_rank {prefill_tp_rank} outside 0..{prefill_tp - 1}")
    tp_contributors(prefill_tp, decode_tp, 0)  # validates the ratio
    return prefill_tp_rank // (prefill_tp // decode_tp)
