"""The reference stack across containers (testcontainers, Ryuk off), shared by ``test_containers`` and
``test_containers_mooncake``: metastore, prefill, decode and proxy, each in its own container on a fresh
``internal`` Docker network (the host reaches the containers at their addresses on it), with the images'
default commands; ``ensure_images`` builds missing images (scripts/images). Also how the tests look at
it: gRPC Health and Stats, what the services still hold (``held``, ``wait_idle``), clean stops
(``stop_times``). The module fixtures ``docker_engine`` (fails every test, saying why, when no
Docker engine answers) and ``reference`` (the single-process engine with the served model's files)
have their bodies here: ``require_docker_engine``, ``served_reference``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")  # no Ryuk image here (no registry)

ROOT = Path(__file__).resolve().parents[3]
BS = 16
MAX_MODEL_LEN = 8192
IDLE_DEADLINE_S = 30.0  # survivors must be idle again within this after a request ended
START_DEADLINE_S = 240.0


def engine_problem() -> str | None:
    """None when a Docker engine answers, else why not."""
    try:
        import docker
    except ImportError as exc:
        return f"the docker SDK is not installed ({exc}); run scripts/bootstrap"
    try:
        client = docker.from_env(timeout=10)
        client.ping()
        client.close()
    except Exception as exc:  # noqa: BLE001 - any failure to reach the engine is the reason the tests fail
        return (
            f"no Docker engine answers at {os.environ.get('DOCKER_HOST', 'unix:///var/run/docker.sock')} "
            f"({type(exc).__name__}: {exc}); start one with scripts/dockerd start (.ci/run does)"
        )
    return None


ENGINE_PROBLEM = engine_problem()


def require_docker_engine() -> None:
    """Fails the caller (a module's autouse fixture: every test of the module) with the reason when no
    engine answers."""
    if ENGINE_PROBLEM is not None:
        pytest.fail(ENGINE_PROBLEM, pytrace=False)


if ENGINE_PROBLEM is None:
    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.network import Network

    import docker

    testcontainers_config.ryuk_disabled = True


# -- the stack ---------------------------------------------------------------------------------------

SERVICES = ("metastore", "prefill", "decode", "proxy")
PORTS = {
    "metastore": 5000,
    "prefill": 8100,
    "prefill-data": 18100,
    "decode": 8200,
    "decode-control": 20050,
    "proxy": 9000,
}
PREFILL_KV = json.dumps(
    {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "SfaRemoteD2HConnector",
                    "kv_role": "kv_producer",
                    "kv_port": PORTS["decode-control"],
                    "kv_connector_extra_config": {"transfer_backend": "kvoffload"},
                },
                {
                    "kv_connector": "AscendStoreConnector",
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {
                        "backend": "kvoffload",
                        "use_layerwise": True,
                        "layerwise_num_shared_buffers": 3,
                        "layerwise_independent_layers": [0],
                    },
                },
            ]
        },
    }
)
DECODE_KV = json.dumps(
    {
        "kv_connector": "SfaRemoteD2HConnector",
        "kv_role": "kv_consumer",
        "kv_port": PORTS["decode-control"],
        "kv_connector_extra_config": {"transfer_backend": "kvoffload", "use_layerwise": True},
    }
)
DECODE_EXTRA = json.dumps(
    {"sparse_kv_offload_config": {"enabled": True, "topk_buffer_size": 128, "dram_size_per_dp_GB": 1}}
)
COMMON = ["--model", "/models/tiny", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BS)]
COMMANDS = {  # the images' default commands (docker/Dockerfile), with the test's sizes spelled out
    "metastore": ["kvoffload-metastore", "--port", "5000", "--dram-size", "256MB"],
    "decode": [
        "kvoffload-decode",
        *COMMON,
        "--port",
        "8200",
        "--shutdown-grace-s",
        "5",
        "--kv-transfer-config",
        DECODE_KV,
        "--additional-config",
        DECODE_EXTRA,
    ],
    "prefill": [
        "kvoffload-prefill",
        *COMMON,
        "--port",
        "8100",
        "--data-port",
        "18100",
        "--metastore",
        "metastore:5000",
        "--host-pool-gb",
        "0.25",
        "--shutdown-grace-s",
        "5",
        "--kv-transfer-config",
        PREFILL_KV,
    ],
    "proxy": [
        "kvoffload-proxy",
        "--port",
        "9000",
        "--prefiller-hosts",
        "prefill",
        "--prefiller-ports",
        "8100",
        "--decoder-hosts",
        "decode",
        "--decoder-ports",
        "8200",
        "--shutdown-grace-s",
        "5",
    ],
}
SHM = {"decode": "1536m", "prefill": "1g"}


def image_tag() -> str:
    """The tag scripts/images gives the images (KVOFFLOAD_IMAGE_TAG, default the project's version)."""
    names = subprocess.run(
        [str(ROOT / "scripts/images"), "--print"], capture_output=True, text=True, check=True
    ).stdout.split()
    return names[0].split(":", 1)[1]


class ContainerStack:
    """The four services in containers on one internal network; the host reaches them by address.
    ``commands``: each container's command (a subclass may run other services)."""

    commands: dict[str, list[str]] = COMMANDS

    def __init__(self, tag: str, log_dir: Path) -> None:
        self.tag, self.log_dir = tag, log_dir
        suffix = uuid.uuid4().hex[:8]
        self.network = Network(docker_network_kw={"internal": True, "labels": {"kvoffload-test": suffix}})
        self.network.name = f"kvoffload-test-{suffix}"
        self.volume = f"kvoffload-test-models-{suffix}"
        self.containers: dict[str, DockerContainer] = {}
        self.client = docker.from_env(timeout=60)
        self._ips: dict[str, str] = {}

    # lifecycle
    def start(self) -> None:
        self.network.create()
        for name in ("metastore", "decode", "prefill"):  # the proxy probes the others: start it last
            self._run(name)
        for name in ("metastore", "decode", "prefill"):
            self.wait_ready(name)
        self._run("proxy")
        self.wait_ready("proxy")

    def _run(self, name: str) -> None:
        c = (
            DockerContainer(f"kvoffload/{name}:{self.tag}")
            .with_command(self.commands[name])
            .with_network(self.network)
            .with_network_aliases(name)
            .with_kwargs(init=True, hostname=name, shm_size=SHM.get(name), labels={"kvoffload-test": "1"})
        )
        if name in ("prefill", "decode"):  # the tiny model, written once into a shared volume
            c.with_volume_mapping(self.volume, "/models", "rw")
        self.containers[name] = c.start()

    def stop(self) -> None:
        for name, c in reversed(list(self.containers.items())):
            try:
                self.save_logs(name)
                c.stop()
            except Exception:  # noqa: BLE001 - best effort: remove what is left
                pass
        try:
            self.network.remove()
        except Exception:  # noqa: BLE001
            pass
        try:
            self.client.volumes.get(self.volume).remove(force=True)
        except Exception:  # noqa: BLE001
            pass
        self.client.close()

    def save_logs(self, name: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        c = self.containers[name].get_wrapped_container()
        (self.log_dir / f"{name}.log").write_bytes(c.logs())

    def wrapped(self, name: str):
        c = self.containers[name].get_wrapped_container()
        c.reload()
        return c

    def ip(self, name: str) -> str:
        if name not in self._ips:  # a restarted container may get another address
            self._ips[name] = self.wrapped(name).attrs["NetworkSettings"]["Networks"][self.network.name]["IPAddress"]
        return self._ips[name]

    def target(self, port_name: str) -> str:
        return f"{self.ip(port_name.split('-')[0])}:{PORTS[port_name]}"

    @property
    def url(self) -> str:
        return f"http://{self.target('proxy')}"

    def wait_ready(self, name: str, deadline_s: float = START_DEADLINE_S) -> None:
        """Until the service answers its health endpoint; fails with its log when it exits or times out."""
        deadline = time.monotonic() + deadline_s
        while True:
            c = self.wrapped(name)
            if c.status != "running":
                self._ips.pop(name, None)
            if c.status in ("exited", "dead"):
                raise AssertionError(f"{name} exited ({c.attrs['State']}) while starting:\n{c.logs().decode()[-3000:]}")
            if c.status == "running" and healthy(self, name):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} not healthy within {deadline_s:.0f}s:\n{c.logs().decode()[-3000:]}")
            time.sleep(0.25)

    def restart(self, name: str) -> None:
        self.wrapped(name).start()
        self._ips.pop(name, None)
        self.wait_ready(name)

    # Stats of every gRPC service that is running
    def stats(self, *names: str) -> dict[str, dict[str, float]]:
        where = {"metastore": "metastore", "prefill": "prefill-data", "decode": "decode-control"}
        return {n: grpc_stats(self.target(where[n])) for n in names or where}


def grpc_health(target: str) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def grpc_stats(target: str):
    import grpc

    from kvoffload_proto.v1 import stats_pb2, stats_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        return stats_pb2_grpc.StatsStub(ch).GetStats(stats_pb2.StatsRequest(), timeout=5)


def healthy(stack: ContainerStack, name: str) -> bool:
    try:
        if name == "metastore":
            return grpc_health(stack.target("metastore")) == "SERVING"
        path = "/healthcheck" if name == "proxy" else "/health"
        with urllib.request.urlopen(f"http://{stack.target(name)}{path}", timeout=3) as r:
            return r.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


def held(stats: dict) -> dict[str, float]:
    """What the services still hold; all zero when idle."""
    out: dict[str, float] = {}
    for name, reply in stats.items():
        c = dict(reply.counters)
        keys = {
            "prefill": ("held_slots", "pool_live_leases", "ledger_open"),
            "decode": ("pool_used_bytes", "pool_live_leases", "sequences", "ledger_open"),
            "metastore": ("live_leases",),
        }[name]
        missing = [k for k in keys if k not in c]
        assert not missing, f"{name}: Stats lack {missing} (a renamed counter must not read as 0); it has {sorted(c)}"
        out.update({f"{name}.{k}": c[k] for k in keys})
    return out


def wait_idle(stack: ContainerStack, *names: str) -> dict[str, float]:
    deadline = time.monotonic() + IDLE_DEADLINE_S
    while True:
        leaks = {k: v for k, v in held(stack.stats(*names)).items() if v}
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.25)


# -- fixtures and their factories ---------------------------------------------------------------------


def ensure_images(services) -> str:
    """The images' tag, once ``kvoffload/SERVICE:TAG`` exists for each of ``services``: built with
    scripts/images when one is missing (also by the other container test modules)."""
    tag = image_tag()
    client = docker.from_env(timeout=60)
    try:
        missing = [s for s in services if not client.images.list(name=f"kvoffload/{s}:{tag}")]
    finally:
        client.close()
    if missing:
        log = ROOT / ".cache" / "images.log"
        log.parent.mkdir(exist_ok=True)
        with open(log, "wb") as f:
            rc = subprocess.run([str(ROOT / "scripts/images")], stdout=f, stderr=subprocess.STDOUT).returncode
        assert rc == 0, f"scripts/images failed ({rc}); its output ends with:\n{log.read_text()[-3000:]}"
    return tag


def running(stack: ContainerStack):
    """``stack`` started, then stopped once the caller is done (a fixture's body)."""
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def served_reference(stack: ContainerStack, tmp_path_factory):
    """The ``reference`` fixture's body: greedy tokens of the single-process engine, with the served
    model's own files (copied out of the decode container) and the stack's sizes."""
    from kvoffload_testing.oracle import greedy_reference

    model_dir = tmp_path_factory.mktemp("served-model") / "tiny"
    model_dir.mkdir()
    for f in stack.wrapped("decode").exec_run(["ls", "/models/tiny"]).output.decode().split():
        stack.containers["decode"].copy_from_container(f"/models/tiny/{f}", model_dir / f)
    return greedy_reference(model_dir, block_size=BS, max_model_len=MAX_MODEL_LEN)


def stop_times(stack: ContainerStack, bounds: dict[str, float]) -> dict[str, float]:
    """Stop each container of ``stack`` named in ``bounds``, in its order (SIGTERM, SIGKILL only after
    10 s), checking it exited 0 within its bound in seconds; seconds each took. The first stop past
    its bound fails at once, with the times so far: a slow stop is a finding, not measured again."""
    took: dict[str, float] = {}
    for name, bound in bounds.items():
        c = stack.wrapped(name)
        t0 = time.monotonic()
        c.stop(timeout=10)
        took[name] = time.monotonic() - t0
        c.reload()
        assert c.attrs["State"]["ExitCode"] == 0, (name, c.attrs["State"], c.logs().decode()[-2000:])
        shown = {k: round(v, 2) for k, v in took.items()}
        assert took[name] < bound, f"{name} took {took[name]:.2f} s to stop, its bound is {bound} s; stop times {shown}"
    print("stop times", {k: round(v, 2) for k, v in took.items()})
    return took
