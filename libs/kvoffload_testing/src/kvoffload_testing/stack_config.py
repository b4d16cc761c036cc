"""A loopback stack's config (``StackConfig``): its ports, pool and transfer backends, mode, and the
names of its services; and the tiny model it runs when given none (``ensure_tiny_model``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kvcore.pool.registry import EMBEDDED, POOL_BACKENDS, STACK_POOLS, StackServer
from kvcore.transferregistry import STACK_TRANSFERS
from svcruntime.tls import TLSConfig

DEFAULT_HOME = Path(os.environ.get("KVOFFLOAD_HOME", Path.home() / ".cache" / "kvoffload"))
API_KEY_ENV = "KVOFFLOAD_API_KEY"  # the proxy's --api-key, passed in its environment (never on a command line)


def _stack_server(pool: str) -> StackServer:
    """Pool backend ``pool``'s server in a stack (the embedded pool and mooncake each declare one)."""
    server = POOL_BACKENDS[pool].stack
    assert server is not None, f"pool backend {pool} declares no stack server"
    return server


METASTORE = _stack_server(EMBEDDED).service  # the service name (and log file) of the stack's metastore
MOONCAKE_MASTER = _stack_server("mooncake").service  # ... and of its mooncake_master (pool "mooncake")
# StackConfig.mode / `kvoffload up --mode`: "pd" (prefill, decode, proxy) or "offload-only" (the seed's
# first deployment: prefills with an AscendStoreConnector alone serve complete requests; no decode, no proxy)
MODES = ("pd", "offload-only")


@dataclass
class StackConfig:
    model: Path
    log_dir: Path
    host: str = "127.0.0.1"
    proxy_port: int = 9000
    prefill_ports: tuple[int, ...] = (8100,)
    decode_ports: tuple[int, ...] = (8200,)
    kv_port: int = 20050
    metastore_port: int = 5000
    prefill_pool_gb: float = 0.25
    max_model_len: int = 16384
    block_size: int = 16
    topk_buffer_size: int = 128  # each decode's hot buffer (>= the model's index_topk; 2x is a good start)
    decode_dram_gb: int = 1  # each decode's host pool (dram_size_per_dp_GB): max_num_seqs x max_model_len rows
    extra_env: dict[str, str] = field(default_factory=dict)  # for every service
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)  # per service name, e.g. "prefill-0"
    service_args: dict[str, list[str]] = field(default_factory=dict)  # extra flags per service name
    tls: TLSConfig | None = None  # --tls-cert/--tls-key/--tls-ca for every gRPC service, and for the probes
    api_key: str | None = None  # the proxy requires "Authorization: Bearer KEY" (see auth_headers)
    pool: str = EMBEDDED  # the prefill's host-pool backend, one of kvcore.pool.registry.STACK_POOLS
    mooncake_port: int = 50051  # pool "mooncake": the master's RPC port
    mooncake_metrics_port: int = 9003  # ... and its metrics / admin /health port
    # the decodes are the data-parallel ranks of ONE decode deployment: one --kv-transfer-config
    # (kv_port), decode i runs --dp-rank i on control port kv_port + i and registers as DP rank i;
    # otherwise each decode is a deployment of its own (kv_port + 16 i, DP rank 0)
    decode_dp: bool = False
    decode_tp: int = 1  # each decode runs --tensor-parallel-size N: rank t of DP rank d on kv_port + d N + t
    mode: str = "pd"  # one of MODES; "offload-only": no decodes and no proxy (decode_ports, proxy_port unused)
    transfer: str = EMBEDDED  # the P→D pull's transfer_backend on every prefill and decode, one of
    # kvcore.transferregistry.STACK_TRANSFERS

    def __post_init__(self) -> None:
        if self.pool not in STACK_POOLS:
            raise ValueError(f"pool: got {self.pool!r}; must be one of {', '.join(map(repr, STACK_POOLS))}")
        if self.mode not in MODES:
            raise ValueError(f"mode: got {self.mode!r}; must be one of {', '.join(map(repr, MODES))}")
        if self.transfer not in STACK_TRANSFERS:
            raise ValueError(f"transfer: got {self.transfer!r}; must be one of {', '.join(map(repr, STACK_TRANSFERS))}")

    def decode_control_port(self, i: int) -> int:
        """Control (Transfer gRPC) port of decode ``i`` (its TP rank 0; rank t listens on this + t)."""
        return self.kv_port + (i * self.decode_tp if self.decode_dp else 16 * i)

    def log_path(self, name: str) -> Path:
        """The log file of service ``name`` (``kvoffload_testing.service.Service`` writes it)."""
        return self.log_dir / f"{name}.log"

    @property
    def mooncake_master(self) -> str:
        """``HOST:PORT`` of the stack's mooncake_master (pool "mooncake")."""
        return f"{self.host}:{self.mooncake_port}"


def ensure_tiny_model(path: Path) -> Path:
    """The tiny seeded model at ``path``, written on first use."""
    if not (path / "config.json").exists():
        from dsamodel.presets import write_tiny

        write_tiny(path)
    return path
