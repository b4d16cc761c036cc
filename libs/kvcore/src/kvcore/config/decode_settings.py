"""Validated settings of a decode (kv_consumer) node: ``decode_settings`` -> ``DecodeSettings``.

The rules that need the node's role, the model (``KVLayout``, ``index_topk``) and the sizes: a
decode needs an SfaRemoteD2HConnector with a ``kv_port`` (the base of its dp*tp control ports),
sparse offload enabled on a model with an indexer, a top-k buffer that fits the indexer's top-k
and the block size, and a host pool that holds every sequence. Every problem found is raised
together in one ``ConfigError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvcore.config.additional import SparseKVOffloadConfig
from kvcore.config.connectors import D2HConnectorConfig
from kvcore.config.errors import ConfigError, describe_value
from kvcore.config.kv_transfer import KVTransferConfig
from kvcore.config.names import D2H_CONNECTOR, SPARSE_KEY
from kvcore.config.node import (
    AdditionalInput,
    KVConfigInput,
    check_positive,
    d2h_of,
    debug_warnings,
    is_int,
    missing_transfer_backend,
    parse_both,
)
from kvcore.layout import KVLayout

MAX_PORT = 65535


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
        if not is_int(dp_rank) or not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank: got {describe_value(dp_rank)}; must be an int in 0..{self.dp - 1}")
        if not is_int(tp_rank) or not 0 <= tp_rank < self.tp:
            raise ValueError(f"tp_rank: got {describe_value(tp_rank)}; must be an int in 0..{self.tp - 1}")
        return self.kv_port + dp_rank * self.tp + tp_rank

    def control_ports(self) -> list[int]:
        """Every control port of this decode deployment (dp*tp consecutive ports from kv_port)."""
        return [self.control_port(d, t) for d in range(self.dp) for t in range(self.tp)]


def _decode_connector_errors(kv: KVTransferConfig, dp: int, tp: int) -> list[str]:
    errors: list[str] = []
    if not kv.is_consumer:
        errors.append(f"kv_role: got {kv.kv_role!r}; a decode node must be 'kv_consumer' (or 'kv_both')")
    found = d2h_of(kv)
    if found is None:
        errors.append(
            f"kv_connector: got {kv.kv_connector!r}; a decode node needs an {D2H_CONNECTOR} "
            "(alone or inside a MultiConnector)"
        )
        return errors
    prefix, node, extra = found
    if extra.transfer_backend is None:
        errors.append(missing_transfer_backend(prefix))
    if node.kv_port is None:
        errors.append(
            f"{prefix}kv_port: required on decode; the base of dp*tp consecutive control ports (int in 1..65535)"
        )
    elif is_int(dp) and is_int(tp) and dp >= 1 and tp >= 1 and node.kv_port + dp * tp - 1 > MAX_PORT:
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
            f"{SPARSE_KEY}.enabled: got False on a decode (kv_consumer) node; must be true "
            "(or keep_device_kv_cache: true, a debug mode)"
        ]
    if index_topk is None:
        return [
            f"{SPARSE_KEY}.enabled: got True but the model has no indexer (index_topk is None); "
            "sparse offload needs a sparse-attention model"
        ]
    if not is_int(index_topk) or index_topk < 1:
        return [f"index_topk: got {describe_value(index_topk)}; must be an int >= 1 or None"]
    errors = []
    size = sparse.topk_buffer_size
    if size < index_topk:
        errors.append(
            f"{SPARSE_KEY}.topk_buffer_size: got {size}; must be >= index_topk {index_topk} "
            f"(2x index_topk = {2 * index_topk} is a good start)"
        )
    if size % block_size:
        errors.append(
            f"{SPARSE_KEY}.topk_buffer_size: got {size}; must be divisible by block_size {block_size} "
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
        f"{SPARSE_KEY}.dram_size_per_dp_GB: got {sparse.dram_size_per_dp_GB} ({given} bytes); the host pool must hold "
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
    kv, additional = parse_both(kv_transfer_config, additional_config)
    sparse = additional.sparse_kv_offload_config
    errors: list[str] = []
    check_positive(errors, max_num_seqs=max_num_seqs, max_model_len=max_model_len, dp=dp, tp=tp)
    errors += _decode_connector_errors(kv, dp, tp)
    errors += _sparse_decode_errors(sparse, index_topk, layout.block_size)
    needed = 0
    if is_int(max_num_seqs) and is_int(max_model_len) and max_num_seqs >= 1 and max_model_len >= 1:
        needed = host_bytes_needed(layout, max_num_seqs=max_num_seqs, max_model_len=max_model_len)
        errors += _host_pool_errors(sparse, needed, layout, max_num_seqs, max_model_len)
    found = d2h_of(kv)
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
        warnings=kv.warnings + additional.warnings + debug_warnings(sparse),
    )
