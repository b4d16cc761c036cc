"""``ServerProcess``: one child server process on loopback, the one launcher of every server a tool
starts: the pool servers (``poolbackends.metastore_server``, ``poolbackends.mooncake_master``,
``poolbackends.memcache_meta``) and the stack's services and vLLM servers (``kvoffload_testing``).

``launch`` is ``spawn`` then ``wait_ready``: ``spawn`` refuses ports something already listens on (a
binary may keep running when its port is taken) and runs the child in a session of its own with
stdout and stderr appended to ``log_path`` (in ``log_dir``); ``wait_ready`` returns once
``answers()`` is true; a child that exits first, or does not answer by the deadline (``start_timeout_s``
from the spawn unless given), raises ``exited(code)`` / ``timed_out()`` or else the subclass's
``START_ERROR`` with the tail of its output. A launcher of several children spawns them all and then
waits for each. ``stop()`` ends it (SIGTERM, SIGKILL after ``STOP_GRACE_S``) and drops ``log_dir``
unless told to keep it (``keep_logs``); ``kill()`` ends it at once (a crash, for fault tests);
``restart()`` launches it again with the same command line. ``start_retrying`` builds and launches
one, trying again (with freshly picked ports) when a port picked free was taken meanwhile.

Subclasses give ``title`` and ``endpoint`` (for messages), ``argv()``, ``ports()`` (what must be
free: ``(what, host, port)``), ``answers()``, and may give ``env()``, ``port_taken(...)`` (the
message), ``exited(code)`` and ``timed_out()`` (a more precise error than the generic one) and
``spawn_failed(error)``; and set ``die_with_parent`` (the child gets SIGTERM when this process dies),
``whole_group`` (stop ends the child's whole process group: a server with workers), ``keep_logs``
(``log_dir`` is the caller's) and ``poll_s`` (how often ``wait_ready`` asks).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from svcruntime.processgroup import stop_group

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


# Runs as ``python -c _DIE_WITH_PARENT PARENT_PID ARGV...``: asks the kernel for SIGTERM when the
# launcher dies (PR_SET_PDEATHSIG), exits if it is already gone, then execs the service. A
# ``preexec_fn`` would do the same in the forked child, but it forces a fork that runs gRPC's fork
# handlers in a launcher with live gRPC channels, and those abort the child (grpc/grpc#43055);
# without one, the child is spawned with vfork and no handler runs.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit('kvoffload: the launcher is gone'); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def dying_with_parent(argv: list[str]) -> list[str]:
    """``argv`` wrapped so that the child gets SIGTERM when this process dies (Linux)."""
    if sys.platform != "linux":
        return argv
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


class ServerProcess(ABC):
    """One child server process (see the module docstring)."""

    START_ERROR: type[Exception] = RuntimeError
    STOP_GRACE_S = 5.0
    die_with_parent = False  # the child is wrapped in dying_with_parent
    whole_group = False  # stop() ends the child's whole process group (processgroup.stop_group)
    keep_logs = False  # stop() leaves log_dir (unless told otherwise)
    poll_s = 0.05  # how often wait_ready asks answers()

    def __init__(self, log_dir: str | Path, log_name: str, start_timeout_s: float) -> None:
        self.log_dir = log_dir
        self.log_path = Path(log_dir, log_name)
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None
        self._spawned_at = 0.0

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

    def timed_out(self) -> Exception | None:
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
    def proc(self) -> subprocess.Popen | None:
        """The child (None before the first spawn)."""
        return self._proc

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
        """Spawn the child and wait until it answers (see the module docstring)."""
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        """Check its ports are free and run the child, its output appended to ``log_path``."""
        for what, host, port in self.ports():
            if port_answers(host, port, 0.2):
                raise self.START_ERROR(self.port_taken(what, host, port))
        argv = self.argv()
        with open(self.log_path, "ab") as out:
            try:
                self._proc = subprocess.Popen(
                    dying_with_parent(argv) if self.die_with_parent else argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.env(),
                    start_new_session=True,
                )
            except OSError as e:
                raise self.spawn_failed(e) from e
        self._spawned_at = time.monotonic()

    def wait_ready(self, deadline: float | None = None) -> None:
        """Return once the spawned child answers; raise when it exits first or ``deadline``
        (``time.monotonic()``; default: ``start_timeout_s`` after the spawn) passes."""
        assert self._proc is not None, "wait_ready before spawn"
        if deadline is None:
            deadline = self._spawned_at + self.start_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise self.exited(code) or self.START_ERROR(
                    f"{self.title} exited with {code} while starting on {self.endpoint}; its output: {self.log_tail()}"
                )
            if self.answers():
                return
            if time.monotonic() > deadline:
                raise self.timed_out() or self.START_ERROR(
                    f"{self.title} did not answer on {self.endpoint} within {self.start_timeout_s} s; "
                    f"its output: {self.log_tail()}"
                )
            time.sleep(self.poll_s)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child if it runs (fault injection: SIGKILL, SIGSTOP, SIGCONT)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def kill(self) -> None:
        """End the child at once (SIGKILL), as a crash would."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def restart(self) -> None:
        """Stop the child (if running) and launch it again with the same command line."""
        self.stop(keep_logs=True)
        self.launch()

    def stop(self, *, keep_logs: bool | None = None, grace_s: float | None = None) -> None:
        """End the child (SIGTERM, SIGKILL after ``grace_s``; its whole group with ``whole_group``) and
        drop ``log_dir`` (unless ``keep_logs``, default the instance's). Idempotent."""
        proc = self._proc
        grace = self.STOP_GRACE_S if grace_s is None else grace_s
        if proc is not None and self.whole_group:
            stop_group(proc, grace, what=f"{self.title}'s")
        elif proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if not (self.keep_logs if keep_logs is None else keep_logs):
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint}, pid={self.pid}, {'running' if self.running else 'stopped'})"
