"""``ServerProcess``: one child server process on loopback (the base of
``poolbackends.mooncake_master.MooncakeMaster`` and ``poolbackends.memcache_meta.MemcacheMetaService``).

``launch`` refuses ports something already listens on (a binary may keep running when its port is
taken), runs the child in a session of its own with stdout and stderr appended to ``log_path``
(in ``log_dir``), and returns once ``answers()`` is true; a child that exits first, or does not
answer within ``start_timeout_s``, raises the subclass's ``START_ERROR`` with the tail of its
output. ``stop()`` ends it (SIGTERM, SIGKILL after ``STOP_GRACE_S``) and drops ``log_dir`` unless
told to keep it; ``kill()`` ends it at once (a crash, for fault tests); ``restart()`` launches it
again with the same command line. ``start_retrying`` builds and launches one, trying again (with
freshly picked ports) when a port picked free was taken meanwhile.

Subclasses give ``title`` and ``endpoint`` (for messages), ``argv()``, ``ports()`` (what must be
free: ``(what, host, port)``), ``answers()``, and may give ``env()``, ``port_taken(...)`` (the
message), ``exited(code)`` (a more precise error than the generic one) and ``spawn_failed(error)``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeVar

S = TypeVar("S", bound="ServerProcess")


def free_port(host: str) -> int:
    """A port on ``host`` that nothing listens on now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_answers(host: str, port: int, timeout_s: float) -> bool:
    """True if a TCP connection to ``host:port`` succeeds within ``timeout_s``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class ServerProcess(ABC):
    """One child server process (see the module docstring)."""

    START_ERROR: type[Exception] = RuntimeError
    STOP_GRACE_S = 5.0

    def __init__(self, log_dir: str, log_name: str, start_timeout_s: float) -> None:
        self.log_dir = log_dir
        self.log_path = os.path.join(log_dir, log_name)
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None

    # ---- what a subclass gives -------------------------------------------------------------------

    @property
    @abstractmethod
    def title(self) -> str:
        """What the server is, for messages (e.g. the binary's name)."""

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """``HOST:PORT`` clients use."""

    @abstractmethod
    def argv(self) -> list[str]:
        """The child's command line."""

    @abstractmethod
    def ports(self) -> list[tuple[str, str, int]]:
        """``(name, host, port)`` the child binds, checked free before it starts."""

    @abstractmethod
    def answers(self) -> bool:
        """True once the child serves."""

    def env(self) -> dict[str, str] | None:
        return None

    def port_taken(self, what: str, host: str, port: int) -> str:
        return f"cannot start {self.title}: its {what} port {host}:{port} is taken; pick another port"

    def exited(self, code: int) -> Exception | None:
        return None

    def spawn_failed(self, error: OSError) -> Exception:
        return self.START_ERROR(f"cannot run {self.argv()[0]}: {error}")

    # ---- the process -----------------------------------------------------------------------------

    @classmethod
    def start_retrying(cls, make: Callable[[], S], tries: int) -> S:
        """``make()`` a server and launch it; on ``START_ERROR`` stop it and try again, ``tries`` in all."""
        while True:
            server = make()
            try:
                server.launch()
                return server
            except cls.START_ERROR:
                server.stop()
                tries -= 1
                if tries <= 0:
                    raise

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - n))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def launch(self) -> None:
        """Run the child and wait until it answers (see the module docstring)."""
        for what, host, port in self.ports():
            if port_answers(host, port, 0.2):
                raise self.START_ERROR(self.port_taken(what, host, port))
        argv = self.argv()
        with open(self.log_path, "ab") as out:
            try:
                self._proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              env=self.env(), start_new_session=True)
            except OSError as e:
                raise self.spawn_failed(e) from e
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise self.exited(code) or self.START_ERROR(
                    f"{self.title} exited with {code} while starting on {self.endpoint}; its output: {self.log_tail()}")
            if self.answers():
                return
            if time.monotonic() > deadline:
                raise self.START_ERROR(f"{self.title} did not answer on {self.endpoint} within {self.start_timeout_s} "
                                       f"s; its output: {self.log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """End the child at once (SIGKILL), as a crash would."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def restart(self) -> None:
        """Stop the child (if running) and launch it again with the same command line."""
        self.stop(keep_logs=True)
        self.launch()

    def stop(self, *, keep_logs: bool = False, grace_s: float | None = None) -> None:
        """End the child (SIGTERM, SIGKILL after ``grace_s``) and drop ``log_dir``. Idempotent."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.STOP_GRACE_S if grace_s is None else grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if not keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint}, pid={self.pid}, {'running' if self.running else 'stopped'})"
