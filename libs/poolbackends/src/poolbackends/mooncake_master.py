"""Start and stop a real ``mooncake_master`` (Mooncake Store's metadata master) on loopback.

``MooncakeMaster.start(MasterConfig())`` runs the ``mooncake_master`` console script of the
``mooncake-transfer-engine-non-cuda`` wheel as a child process, its RPC server and its HTTP
metrics/admin server both bound to ``MasterConfig.host`` (127.0.0.1 unless told: the binary's own
default is 0.0.0.0), on free ports unless given, and returns once the master answers: its admin
``/health`` says ``service_ready`` and its RPC port accepts connections. ``stop()`` ends it
(SIGTERM, then SIGKILL), ``kill()`` ends it at once (a crash, for fault tests), ``restart()``
starts a fresh master on the same ports (a restarted master knows no key). Used by the tests and
by ``kvoffload up --pool mooncake``.

``kv_lease_ttl_ms`` is the master's ``--default_kv_lease_ttl``: how long an object stays leased
(not removable without force) after a client checks or reads it. ``MooncakeHostPool`` must be
told the same value (``store_lease_ttl_ms``) to keep readers' leases alive. A missing wheel or a
missing ``libibverbs1`` raises ``MooncakeNotInstalled`` naming the binary and what to install.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from kvcore.pool.host_pool import check_count, check_positive
from svcruntime.serverprocess import ServerProcess, free_port, port_answers

__all__ = [
    "INSTALL_HINT",
    "MasterConfig",
    "MooncakeMaster",
    "MooncakeMasterError",
    "MooncakeNotInstalled",
    "find_master_binary",
    "free_port",
    "master_argv",
    "port_answers",
]

INSTALL_HINT = (
    "install Mooncake Store with `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` "
    "(or `pip install kvoffload-poolbackends[mooncake]`) and Debian's `apt-get install -y "
    "libibverbs1`; scripts/install-mooncake does both"
)


class MooncakeNotInstalled(ImportError):
    """The Mooncake wheel, its ``mooncake_master`` binary or the ``libibverbs1`` it links is missing."""


class MooncakeMasterError(RuntimeError):
    """``mooncake_master`` did not start, or exited, or did not answer in time."""


@dataclass(frozen=True)
class MasterConfig:
    """How to run one ``mooncake_master``. Ports 0 mean "pick a free one"."""

    host: str = "127.0.0.1"
    rpc_port: int = 0
    metrics_port: int = 0
    kv_lease_ttl_ms: int = 5_000
    client_ttl_s: int = 10
    start_timeout_s: float = 20.0
    binary: str | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("rpc_port", "metrics_port"):
            v = getattr(self, name)
            if not isinstance(v, int) or not 0 <= v < 65536:
                raise ValueError(f"{name} must be a port number 0..65535 (0: a free one), got {v!r}")
        check_count("kv_lease_ttl_ms", self.kv_lease_ttl_ms)
        check_count("client_ttl_s", self.client_ttl_s)
        check_positive("start_timeout_s", self.start_timeout_s)


def find_master_binary(binary: str | None = None) -> str:
    """Path of ``mooncake_master``: ``binary`` if given, else beside this Python, else on PATH."""
    if binary is not None:
        if not os.access(binary, os.X_OK):
            raise MooncakeNotInstalled(f"mooncake_master binary {binary!r} is not an executable file; {INSTALL_HINT}")
        return binary
    beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mooncake_master")
    if found is None:
        raise MooncakeNotInstalled(f"no mooncake_master binary beside {sys.executable} or on PATH; {INSTALL_HINT}")
    return found


def master_argv(binary: str, config: MasterConfig, rpc_port: int, metrics_port: int) -> list[str]:
    """The command line of a master per ``config`` on those ports (also for launchers of their own,
    such as ``kvoffload up --pool mooncake``): RPC and metrics bound to ``config.host``, no HTTP
    metadata server (clients use the P2P handshake)."""
    c = config
    return [
        binary,
        f"--rpc_address={c.host}",
        f"--rpc_port={rpc_port}",
        f"--metrics_host={c.host}",
        f"--metrics_port={metrics_port}",
        f"--default_kv_lease_ttl={c.kv_lease_ttl_ms}",
        f"--client_ttl={c.client_ttl_s}",
        "--enable_http_metadata_server=false",
        *c.extra_args,
    ]


class MooncakeMaster(ServerProcess):
    """One running ``mooncake_master`` child process (see the module docstring)."""

    START_ERROR = MooncakeMasterError

    def __init__(self, config: MasterConfig, binary: str, rpc_port: int, metrics_port: int) -> None:
        super().__init__(tempfile.mkdtemp(prefix="mooncake-master-"), "master.log", config.start_timeout_s)
        self.config = config
        self.binary = binary
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port

    @classmethod
    def start(cls, config: MasterConfig | None = None) -> MooncakeMaster:
        """Start a master and wait until it answers (``MooncakeMasterError`` past ``start_timeout_s``)."""
        c = config or MasterConfig()
        binary = find_master_binary(c.binary)
        tries = 3 if c.rpc_port == 0 or c.metrics_port == 0 else 1  # a picked port may be taken
        return cls.start_retrying(
            lambda: cls(c, binary, c.rpc_port or free_port(c.host), c.metrics_port or free_port(c.host)), tries
        )

    @property
    def address(self) -> str:
        """``host:rpc_port``, what clients pass as ``master_server_addr``."""
        return f"{self.config.host}:{self.rpc_port}"

    @property
    def health_url(self) -> str:
        return f"http://{self.config.host}:{self.metrics_port}/health"

    # ---- ServerProcess -------------------------------------------------------------------------

    @property
    def title(self) -> str:
        return self.binary

    @property
    def endpoint(self) -> str:
        return f"{self.address} / {self.health_url}"

    def argv(self) -> list[str]:
        return master_argv(self.binary, self.config, self.rpc_port, self.metrics_port)

    def ports(self) -> list[tuple[str, str, int]]:
        return [("RPC", self.config.host, self.rpc_port), ("metrics", self.config.host, self.metrics_port)]

    def port_taken(self, what: str, host: str, port: int) -> str:
        return (
            f"cannot start {self.binary} on {host}:{port}: something listens there already (another "
            f"mooncake_master?); pick another port"
        )

    def exited(self, code: int) -> Exception | None:
        tail = self.log_tail()
        if "libibverbs" in tail:
            return MooncakeNotInstalled(
                f"{self.binary} cannot load libibverbs.so.1 (exit {code}); {INSTALL_HINT}. Its output: {tail}"
            )
        return None

    def spawn_failed(self, error: OSError) -> Exception:
        return MooncakeNotInstalled(f"cannot run {self.binary}: {error}; {INSTALL_HINT}")

    def answers(self) -> bool:
        """The admin ``/health`` says ``service_ready`` and the RPC port accepts connections."""
        return self._healthy() and port_answers(self.config.host, self.rpc_port, 0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=0.5) as r:
                return r.status == 200 and bool(json.loads(r.read()).get("service_ready"))
        except (OSError, ValueError, urllib.error.URLError):
            return False
