"""``Service``: one server of a stack (metastore, prefill, decode, proxy, a vLLM server) as a child
process, on ``svcruntime.serverprocess.ServerProcess``: its output appended to ``NAME.log`` in a log
folder the caller keeps, SIGTERM when the launcher dies, ready when its health URL answers
(``stack_client.healthy``: HTTP 200 or gRPC SERVING). And the command lines of kvoffload's own
servers every launcher here runs: ``metastore_command``, ``proxy_command``."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from kvoffload_testing.stack_client import healthy
from svcruntime.serverprocess import ServerProcess
from svcruntime.tls import TLSConfig

_S = TypeVar("_S", bound="Service")


def binary(name: str) -> str:
    """The console script ``name`` installed beside this Python."""
    return str(Path(sys.executable).with_name(name))


def metastore_command(host: str, port: int, *, dram_size: str | None = None, tls: TLSConfig | None = None) -> list[str]:
    """A ``kvoffload-metastore`` on ``host:port`` (reporting ``dram_size`` per LocalService when given)."""
    dram = ["--dram-size", dram_size] if dram_size is not None else []
    return [binary("kvoffload-metastore"), "--host", host, "--port", str(port), *dram, *(tls.flags() if tls else [])]


def proxy_command(host: str, port: int, prefill_ports: Sequence[int], decode_ports: Sequence[int]) -> list[str]:
    """A ``kvoffload-proxy`` on ``host:port`` in front of the prefill and decode HTTP ports on ``host``."""
    return [
        binary("kvoffload-proxy"),
        "--host",
        host,
        "--port",
        str(port),
        "--prefiller-hosts",
        *[host] * len(prefill_ports),
        "--prefiller-ports",
        *map(str, prefill_ports),
        "--decoder-hosts",
        *[host] * len(decode_ports),
        "--decoder-ports",
        *map(str, decode_ports),
    ]


class Service(ServerProcess):
    """One child server named ``name`` (see the module docstring). A start that fails raises
    ``RuntimeError`` (it exited; the end of its log) or ``TimeoutError`` (not healthy in time)."""

    STOP_GRACE_S = 10.0
    die_with_parent = True
    keep_logs = True
    poll_s = 0.2

    def __init__(
        self,
        name: str,
        argv: list[str],
        health: str,
        log_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        tls: TLSConfig | None = None,
        start_timeout_s: float = 180.0,
        whole_group: bool = False,
    ) -> None:
        super().__init__(log_dir, f"{name}.log", start_timeout_s)
        self.name, self.health, self.tls = name, health, tls
        self._argv, self._env = argv, dict(env) if env is not None else None
        self.whole_group = whole_group

    @property
    def title(self) -> str:
        return self.name

    @property
    def endpoint(self) -> str:
        return self.health

    def argv(self) -> list[str]:
        return self._argv

    def env(self) -> dict[str, str] | None:
        return self._env

    def ports(self) -> list[tuple[str, str, int]]:
        return []

    def answers(self) -> bool:
        return healthy(self.health, self.tls)

    def exited(self, code: int) -> Exception:
        return RuntimeError(
            f"{self.name} exited with status {code} while starting; its log ({self.log_path}) "
            f"ends with:\n{self.log_path.read_text(errors='replace')[-2000:]}"
        )

    def timed_out(self) -> Exception:
        return TimeoutError(f"{self.name} not healthy at {self.health} in time; see {self.log_path}")

    def start(self: _S) -> _S:
        """Truncate its log, spawn it and wait until it is healthy (stopped again when it is not)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")
        try:
            self.launch()
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self: _S) -> _S:
        return self.start()
