"""The D2H connector's typed settings (``D2HSettings``), read from vLLM's ``kv_transfer_config``
and parallel config by ``d2h_settings``: unknown keys are errors, and a ``ConfigError`` names the
field. It takes the transfer backends whose ``kvcore.transferregistry`` entry has no
``vllm_refusal`` (``vllm_refusal`` here words the error of the others).

Tensor parallel: every TP rank's worker runs its own producer or consumer; decode TP rank t listens
on ``kv_port + dp_rank × tp + t``. Whether a rank's KV is its own slice of the heads or a copy of
every rank's (``kv_replicated``: an MLA latent, or a model of one KV head) decides how a prefill
rank shares a decode rank's rows with the other ranks that feed it (``kvoffload_vllm.d2h_tp``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcore.config.connectors import D2HConnectorConfig
from kvcore.config.errors import ConfigError
from kvcore.config.names import D2H_CONNECTOR
from kvcore.config.parse import parse_kv_transfer_config
from kvcore.transferregistry import EMBEDDED, TRANSFERS, either
from kvoffload_vllm.store_mmc import warn_unread
from kvoffload_vllm.tp import kv_heads_copied, kv_replicated, tp_rank_of
from kvoffload_vllm.unread_config import check_additional_config, check_d2h_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig

DEFAULT_ADVERTISE_HOST = "127.0.0.1"
DEFAULT_PEER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class D2HSettings:
    role: str  # "kv_producer" | "kv_consumer"
    control_port: int | None  # consumer: kv_port + dp_rank * tp + tp_rank
    advertise_host: str
    data_port: int
    peer_timeout_s: float
    read_timeout_s: float
    dp_rank: int = 0  # consumer: registered with the proxy as remote_dp_rank
    kv_digests: bool = False  # consumer: log each layer's prompt KV digest once it landed
    transfer_backend: str = EMBEDDED  # one of kvcore.transferregistry.VLLM_TRANSFERS
    tp_rank: int = 0
    tp_size: int = 1
    kv_replicated: bool = False  # every TP rank holds the same KV (MLA latent, one KV head)
    kv_heads: int = 0  # KV heads of this rank's cache (0: not known)

    @property
    def base_port(self) -> int | None:
        """The consumer's TP rank 0's control port: the one registered with the proxy."""
        return None if self.control_port is None else self.control_port - self.tp_rank


def d2h_settings(vllm_config: VllmConfig) -> D2HSettings:
    """The typed SfaRemoteD2HConnector config (unknown keys are errors); ConfigError names the field."""
    kv = vllm_config.kv_transfer_config
    if kv is None:
        raise ConfigError([f"kv_transfer_config: missing; the {D2H_CONNECTOR} is configured there"])
    parsed = parse_kv_transfer_config(
        {
            "kv_connector": kv.kv_connector,
            "kv_role": kv.kv_role,
            "kv_port": kv.kv_port,
            "kv_connector_extra_config": dict(kv.kv_connector_extra_config or {}),
        },
        strict=True,
    )
    extra = parsed.kv_connector_extra_config
    check_additional_config(vllm_config.additional_config, D2H_CONNECTOR)
    warn_unread(D2H_CONNECTOR)
    check_d2h_keys(kv.kv_role, kv.kv_port, dict(kv.kv_connector_extra_config or {}))
    if parsed.kv_connector != D2H_CONNECTOR or not isinstance(extra, D2HConnectorConfig):
        raise ConfigError([f"kv_transfer_config.kv_connector: got {kv.kv_connector!r}; this class is {D2H_CONNECTOR}"])
    _check_role(parsed.kv_role, extra)
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size > 1:
        raise ConfigError(
            [
                f"{D2H_CONNECTOR}: pipeline parallel is not supported; got pipeline_parallel_size "
                f"{par.pipeline_parallel_size} (tensor parallel is)"
            ]
        )
    tp, tp_rank = par.tensor_parallel_size, tp_rank_of(vllm_config)
    check_head_split(vllm_config)
    decode = parsed.kv_role == "kv_consumer"
    control_port = _control_port(parsed.kv_port, par.data_parallel_rank, tp, tp_rank) if decode else None
    peer_timeout = extra.peer_timeout_s or DEFAULT_PEER_TIMEOUT_S
    return D2HSettings(
        parsed.kv_role,
        control_port,
        extra.advertise_host or DEFAULT_ADVERTISE_HOST,
        extra.data_port or 0,
        peer_timeout,
        read_timeout_s=max(30.0, 3 * peer_timeout),
        dp_rank=par.data_parallel_rank,
        kv_digests=extra.kv_digests,
        transfer_backend=extra.transfer_backend or EMBEDDED,
        tp_rank=tp_rank,
        tp_size=tp,
        kv_replicated=kv_replicated(vllm_config),
        kv_heads=vllm_config.model_config.get_num_kv_heads(par),
    )


def _check_role(kv_role: str | None, extra: D2HConnectorConfig) -> None:
    """The role is the prefill's or the decode's, the backend one vLLM runs, digests the decode's."""
    if kv_role not in ("kv_producer", "kv_consumer"):
        raise ConfigError(
            [
                f"kv_transfer_config.kv_role: got {kv_role!r}; the {D2H_CONNECTOR} is either "
                "the prefill ('kv_producer') or the decode ('kv_consumer')"
            ]
        )
    refusal = vllm_refusal(extra.transfer_backend)
    if refusal:
        raise ConfigError([refusal])
    if extra.kv_digests and kv_role != "kv_consumer":
        raise ConfigError(
            [
                "kv_connector_extra_config.kv_digests: the decode ('kv_consumer') logs the digests of the KV "
                f"it pulled; this is the prefill ({kv_role!r}): remove it"
            ]
        )


def vllm_refusal(transfer_backend: str | None) -> str:
    """The error of a transfer_backend the vLLM connector does not take, naming why (its registry
    entry's ``vllm_refusal``) and the ones it takes; "" for one it takes (None: the embedded path)."""
    entry = TRANSFERS.get(transfer_backend) if transfer_backend is not None else None
    if entry is None or not entry.vllm_refusal:
        return ""  # taken, or not a transfer backend at all (the config's parse refused it already)
    return (
        f"kv_connector_extra_config.transfer_backend: got {transfer_backend!r}; inside vLLM the pull runs on "
        f"{either(b.name for b in TRANSFERS.values() if not b.vllm_refusal)} ({entry.vllm_refusal})"
    )


def _control_port(kv_port: int | None, dp_rank: int, tp: int, tp_rank: int) -> int:
    """The decode rank's control port: kv_port + dp_rank * tp + tp_rank (its whole range below 65536)."""
    if kv_port is None:
        raise ConfigError(
            ["kv_transfer_config.kv_port: missing; the decode's control port is kv_port + dp_rank * tp + tp_rank"]
        )
    base_port = kv_port + dp_rank * tp
    if base_port + tp - 1 > 65535:
        raise ConfigError(
            [
                f"kv_transfer_config.kv_port: {kv_port} + dp_rank {dp_rank} x tp {tp} "
                f"+ tp_rank (up to {tp - 1}) is beyond 65535"
            ]
        )
    return base_port + tp_rank


def check_head_split(vllm_config: VllmConfig) -> None:
    """ConfigError where vLLM copies each KV head to some ranks only: no TP P/D split covers that."""
    copies = kv_heads_copied(vllm_config)
    if copies > 1:
        tp = vllm_config.parallel_config.tensor_parallel_size
        raise ConfigError(
            [
                f"{D2H_CONNECTOR}: tensor_parallel_size {tp} over {tp // copies} KV heads: vLLM copies each head "
                f"to {copies} ranks, and the P/D pull takes either every rank's own heads or one head every rank "
                "holds; use a TP that divides the KV heads"
            ]
        )
