"""``kvoffload up`` / ``kvoffload demo``: the whole P/D stack on loopback, one process per service.

Configs are the guide's (MultiConnector prefill with layerwise reuse, sparse-offload decode); only
``backend`` / ``transfer_backend`` name kvoffload's backends: the embedded ``"kvoffload"`` ones, or
with ``StackConfig.pool = "mooncake"`` (``kvoffload up --pool mooncake``) the prefill's host pool on
Mooncake Store, served by a real ``mooncake_master`` the stack runs in place of the metastore, and
with ``StackConfig.transfer = "mooncake"`` the P→D pull over Mooncake Transfer Engine. The
tiny model is created on first use. Every child logs JSON to its own file; Ctrl-C (or SIGTERM)
stops them all.

Its parts: its config (``kvoffload_testing.stack_config``), the ports (``kvoffload_testing.ports``),
the services' connector configs (``kvoffload_testing.connector_configs``), each service as a child
process (``kvoffload_testing.service``, on ``svcruntime.serverprocess``) and the client side of a
running stack (``kvoffload_testing.stack_client``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from kvcore.pool.registry import EMBEDDED
from kvoffload_testing.connector_configs import (
    decode_additional_config,
    decode_kv_transfer_config,
    offload_only_kv_transfer_config,
    prefill_kv_transfer_config,
)
from kvoffload_testing.ports import DATA_PORT_OFFSET
from kvoffload_testing.service import Service, binary, metastore_command, proxy_command
from kvoffload_testing.stack_config import (
    API_KEY_ENV,
    METASTORE,
    MOONCAKE_MASTER,
    StackConfig,
)
from kvoffload_testing.stack_threads import colocated_threads_env
from svcruntime.serverprocess import port_answers


def decode_services(c: StackConfig, common: list[str]) -> list[tuple[str, list[str], str]]:
    """(name, argv, health URL) of the stack's decodes; ``common`` are the flags every service gets."""
    out = []
    for i, port in enumerate(c.decode_ports):
        # a deployment reserves dp * tp consecutive control ports from its kv_port
        kv_port, dp = (c.kv_port, ["--dp-rank", str(i)]) if c.decode_dp else (c.decode_control_port(i), [])
        tp = ["--tensor-parallel-size", str(c.decode_tp)] if c.decode_tp > 1 else []
        out.append(
            (
                f"decode-{i}",
                [
                    binary("kvoffload-decode"),
                    *common,
                    "--port",
                    str(port),
                    *dp,
                    *tp,
                    "--kv-transfer-config",
                    decode_kv_transfer_config(kv_port, c.transfer),
                    "--additional-config",
                    decode_additional_config(c.topk_buffer_size, c.decode_dram_gb),
                ],
                f"http://{c.host}:{port}/health",
            )
        )
    return out


def prefill_services(c: StackConfig, common: list[str]) -> list[tuple[str, list[str], str]]:
    """(name, argv, health URL) of the stack's prefills; ``common`` are the flags every service gets."""
    mooncake = c.pool == "mooncake"
    index = [] if mooncake else ["--local-config", str(mmc_local_conf(c))]  # mooncake: the master indexes
    master = c.mooncake_master if mooncake else None
    prefill_kv = (
        offload_only_kv_transfer_config(mooncake_master=master)
        if c.mode == "offload-only"
        else prefill_kv_transfer_config(c.kv_port, mooncake_master=master, transfer=c.transfer)
    )
    return [
        (
            f"prefill-{i}",
            [
                binary("kvoffload-prefill"),
                *common,
                "--port",
                str(port),
                "--data-port",
                str(port + DATA_PORT_OFFSET),
                *index,
                "--host-pool-gb",
                str(c.prefill_pool_gb),
                "--kv-transfer-config",
                prefill_kv,
            ],
            f"http://{c.host}:{port}/health",
        )
        for i, port in enumerate(c.prefill_ports)
    ]


def mmc_local_conf(c: StackConfig) -> Path:
    """The guide's ``mmc-local.conf`` of the stack's prefills, written to the log directory: its
    ``ock.mmc.meta_service_url`` names the stack's metastore (the prefill's index, as a user moving
    from the reference configures it; ``--metastore`` would say the same)."""
    path = c.log_dir / "mmc-local.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    host = f"[{c.host}]" if ":" in c.host else c.host
    path.write_text(
        f"# written by kvoffload (the stack's prefills)\nock.mmc.meta_service_url = tcp://{host}:{c.metastore_port}\n"
    )
    return path


def metastore_service(c: StackConfig) -> tuple[str, list[str], str]:
    """(name, argv, health URL) of the stack's metastore."""
    return (
        METASTORE,
        metastore_command(c.host, c.metastore_port, dram_size=f"{int(c.prefill_pool_gb * 1024)}MB", tls=c.tls),
        f"grpc://{c.host}:{c.metastore_port}",
    )


def mooncake_master_service(c: StackConfig) -> tuple[str, list[str], str]:
    """(name, argv, health URL) of the stack's mooncake_master (pool "mooncake"): the wheel's binary
    with RPC and metrics bound to the stack's host (poolbackends.mooncake_master.master_argv), healthy
    when its admin ``/health`` answers. ``MooncakeNotInstalled`` (what to install) without the wheel."""
    from poolbackends.mooncake_master import MasterConfig, find_master_binary, master_argv

    config = MasterConfig(host=c.host, rpc_port=c.mooncake_port, metrics_port=c.mooncake_metrics_port)
    return (
        MOONCAKE_MASTER,
        master_argv(find_master_binary(), config, c.mooncake_port, c.mooncake_metrics_port),
        f"http://{c.host}:{c.mooncake_metrics_port}/health",
    )


# how the stack runs the server of each pool it takes (kvcore.pool.registry.STACK_POOLS) on its ports
POOL_SERVERS = {EMBEDDED: metastore_service, "mooncake": mooncake_master_service}


def proxy_service(c: StackConfig) -> tuple[str, list[str], str]:
    """(name, argv, health URL) of the stack's proxy, in front of every prefill and decode HTTP port."""
    return (
        "proxy",
        proxy_command(c.host, c.proxy_port, c.prefill_ports, c.decode_ports),
        f"http://{c.host}:{c.proxy_port}/healthcheck",
    )


class Stack:
    """The running services; ``start`` waits until every one is healthy, ``stop`` ends them all.

    The engine lives in ``commands`` (this class: the reference services); the launching is the same
    for every engine (``kvoffload_testing.vllm_stack.VllmStack`` overrides ``commands`` and the hooks below)."""

    start_timeout_s = 180.0  # start()'s default: every service healthy within this
    stop_grace_s = 10.0  # stop()'s default: how long each service gets to exit after SIGTERM
    # services spawned only once every service before them is healthy; the others all start at once
    spawn_after_healthy: frozenset[str] = frozenset()
    whole_groups = False  # stop ends each service's whole process group (servers with worker processes)

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.services: list[Service] = []  # in start order, as they are spawned
        # the prefills register their pool with the pool's server at start-up: it must answer by then.
        # With the master, the service after it (and with it every later one) is spawned once the master
        # is healthy; with the metastore, the first prefill (and every later service) — the decode starts
        # beside the metastore (a metastore that took 67 s to start on a loaded machine lost that race)
        names = [name for name, _, _ in self.commands()]
        gate = names[1] if cfg.pool == "mooncake" else next((n for n in names if n.startswith("prefill-")), None)
        if gate is not None:
            self.spawn_after_healthy = self.spawn_after_healthy | {gate}

    @property
    def url(self) -> str:
        """Where clients send requests: the proxy, or in offload-only mode the first prefill."""
        port = self.cfg.prefill_ports[0] if self.cfg.mode == "offload-only" else self.cfg.proxy_port
        return f"http://{self.cfg.host}:{port}"

    @property
    def auth_headers(self) -> dict[str, str]:
        """What a client of the proxy sends: the bearer key when the stack has one."""
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    def commands(self) -> list[tuple[str, list[str], str]]:
        """(name, argv, health URL) of every service, in start order."""
        c = self.cfg
        tls = c.tls.flags() if c.tls else []
        common = [
            "--model",
            str(c.model),
            "--host",
            c.host,
            "--max-model-len",
            str(c.max_model_len),
            "--block-size",
            str(c.block_size),
            *tls,
        ]
        offload_only = c.mode == "offload-only"
        out = [POOL_SERVERS[c.pool](c)]
        if not offload_only:
            out += decode_services(c, common)
        out += prefill_services(c, common)
        if not offload_only:
            out.append(proxy_service(c))
        return [(name, argv + c.service_args.get(name, []), health) for name, argv, health in out]

    def engine_env(self, name: str) -> dict[str, str]:
        """What the engine adds to service ``name``'s environment (under the config's own env): for the
        reference engine, the thread plan of services sharing this host's cores."""
        return colocated_threads_env(name, len(os.sched_getaffinity(0)), os.environ)

    def _service(self, name: str, argv: list[str], health: str) -> Service:
        """One service of the stack, its output appended to ``log_dir/NAME.log``."""
        env = {**os.environ, **self.engine_env(name), **self.cfg.extra_env}
        env.pop(API_KEY_ENV, None)
        if name == "proxy" and self.cfg.api_key:
            env[API_KEY_ENV] = self.cfg.api_key
        return Service(
            name,
            argv,
            health,
            self.cfg.log_dir,
            env={**env, **self.cfg.service_env.get(name, {})},
            tls=self.cfg.tls,
            whole_group=self.whole_groups,
        )

    def start(self, timeout_s: float | None = None, progress: bool = True) -> None:
        """Spawn every service in ``commands`` order (one waiting first for those before it when it is
        in ``spawn_after_healthy``) and wait, in the same order, until each is healthy; on a failure
        or a timeout stop what was started and raise."""
        self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
        services = [self._service(*command) for command in self.commands()]
        self._check_master_ports()
        for service in services:
            service.log_path.write_bytes(b"")
        deadline = time.monotonic() + (self.start_timeout_s if timeout_s is None else timeout_s)
        try:
            with tqdm(
                total=len(services), desc="starting kvoffload", unit="service", disable=not progress, file=sys.stderr
            ) as bar:
                ready = 0  # services [0, ready) answered their health check

                def wait_healthy_until(end: int) -> None:
                    nonlocal ready
                    for service in services[ready:end]:
                        bar.set_postfix_str(service.name)
                        service.wait_ready(deadline)
                        bar.update(1)
                        ready += 1

                for i, service in enumerate(services):
                    if service.name in self.spawn_after_healthy:
                        wait_healthy_until(i)
                    service.spawn()
                    self.services.append(service)
                wait_healthy_until(len(services))
        except BaseException:
            self.stop()
            raise

    def _check_master_ports(self) -> None:
        """Pool "mooncake": a mooncake_master keeps running when its RPC port is taken, and a health
        probe would then reach whatever listens on the metrics port: refuse ports something listens
        on up front (a connect, not a bind: the master binds over connections in TIME_WAIT)."""
        c = self.cfg
        if c.pool != "mooncake":
            return
        taken = [p for p in (c.mooncake_port, c.mooncake_metrics_port) if port_answers(c.host, p, 0.5)]
        if taken:
            raise RuntimeError(
                f"cannot start {MOONCAKE_MASTER} on {c.host}: something listens on port(s) {taken} "
                f"(another mooncake_master?); pick others (StackConfig.mooncake_port / "
                f"mooncake_metrics_port)"
            )

    def service(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def http_url(self, name: str) -> str:
        """``http://HOST:PORT`` of service ``name`` (one with an HTTP health check), where its health
        check reaches it (a split stack's decode may live at another address than ``cfg.host``)."""
        health = self.service(name).health
        if not health.startswith("http"):
            raise ValueError(f"service {name!r} has no HTTP health check ({health!r})")
        return health.rsplit("/", 1)[0]

    def process(self, name: str) -> subprocess.Popen:
        proc = self.service(name).proc
        assert proc is not None  # a started stack's services are all spawned
        return proc

    def events(self, name: str, event: str, **fields) -> list[dict]:
        """The JSON log lines of service ``name`` whose ``event`` is ``event`` and whose other fields
        equal ``fields`` (e.g. ``request_id=...``), in log order."""
        out = []
        for line in self.cfg.log_path(name).read_text().splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == event and all(record.get(k) == v for k, v in fields.items()):
                    out.append(record)
        return out

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to one service (fault injection: SIGKILL, SIGSTOP, SIGCONT)."""
        self.service(name).signal(sig)

    def restart(self, name: str, timeout_s: float = 120.0) -> None:
        """Start ``name`` again if it is not running (same command line) and wait until it is healthy."""
        service = self.service(name)
        if service.running:
            return
        service.spawn()
        service.wait_ready(time.monotonic() + timeout_s)

    def stop(self, grace_s: float | None = None) -> None:
        """Stop in reverse start order (the reference engine's: proxy, prefills, decodes, then the
        metastore, or with pool "mooncake" the mooncake_master):
        SIGTERM, wait up to ``grace_s`` (default ``stop_grace_s``), then SIGKILL — each service
        drains before the ones it depends on go."""
        for service in reversed(self.services):
            try:
                service.stop(grace_s=self.stop_grace_s if grace_s is None else grace_s)
            except RuntimeError as exc:  # a member of its group survived SIGKILL: keep stopping the others
                print(f"kvoffload: {exc}", file=sys.stderr)
        self.services.clear()

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
