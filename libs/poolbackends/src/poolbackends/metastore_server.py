"""Start and stop a real ``kvoffload-metastore`` (the index of backend ``"kvoffload"``'s pools) on loopback.

``MetastoreServer.start(MetastoreSettings())`` runs the ``kvoffload-metastore`` console script beside
this Python as a child process bound to ``MetastoreSettings.host`` (127.0.0.1 unless told), on a free
port unless given, and returns once a ``MetaStoreClient`` call answers. ``stop()``, ``kill()`` and
``restart()`` are ``svcruntime.serverprocess.ServerProcess``'s; its output goes to ``log_dir``.
``MetastoreError`` when it exits or does not answer in time, with the tail of its output.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass

from kvcore.pool.host_pool import PoolError
from poolbackends.client import MetaStoreClient
from svcruntime.serverprocess import ServerProcess, free_port

BINARY = "kvoffload-metastore"


class MetastoreError(RuntimeError):
    """The metastore did not start, exited, or did not answer in time."""


@dataclass(frozen=True)
class MetastoreSettings:
    """How to run one metastore. Port 0 means "pick a free one"."""

    host: str = "127.0.0.1"
    port: int = 0
    world_size: int = 256
    log_level: str = "info"
    start_timeout_s: float = 30.0


class MetastoreServer(ServerProcess):
    """One running ``kvoffload-metastore`` child process (see the module docstring)."""

    START_ERROR = MetastoreError

    def __init__(self, settings: MetastoreSettings, port: int) -> None:
        super().__init__(tempfile.mkdtemp(prefix="kvoffload-metastore-"), "metastore.log", settings.start_timeout_s)
        self.settings = settings
        self.port = port
        self.binary = os.path.join(os.path.dirname(sys.executable), BINARY)

    @classmethod
    def start(cls, settings: MetastoreSettings | None = None) -> MetastoreServer:
        """Start a metastore and wait until it answers (``MetastoreError`` past ``start_timeout_s``)."""
        s = settings or MetastoreSettings()
        return cls.start_retrying(lambda: cls(s, s.port or free_port(s.host)), 3 if s.port == 0 else 1)

    @property
    def address(self) -> str:
        """``host:port``, what pools and clients pass as the metastore's target."""
        return f"{self.settings.host}:{self.port}"

    # ---- ServerProcess -------------------------------------------------------------------------

    @property
    def title(self) -> str:
        return self.binary

    @property
    def endpoint(self) -> str:
        return self.address

    def argv(self) -> list[str]:
        s = self.settings
        return [
            self.binary,
            "--host",
            s.host,
            "--port",
            str(self.port),
            "--world-size",
            str(s.world_size),
            "--log-level",
            s.log_level,
        ]

    def ports(self) -> list[tuple[str, str, int]]:
        return [("gRPC", self.settings.host, self.port)]

    def answers(self) -> bool:
        try:
            with MetaStoreClient(self.address, timeout_s=0.5) as client:
                client.meta_stats()
        except PoolError:  # MetaStoreUnavailable until it serves
            return False
        return True
