"""``bench vllm``'s ``pull_by_backend``: the P/D pull inside vLLM on each transfer backend the vLLM
connectors take (``kvcore.transferregistry.VLLM_TRANSFERS``, each by its path across hosts), side by side.

- ``grpc_stream``: ``transfer_backend: "kvoffload"``, the decode streams the blocks from the prefill's
  LayerSource over gRPC;
- ``mooncake``: ``transfer_backend: "mooncake"``, the decode reads them through Mooncake Transfer
  Engine (TCP) straight into its blocks.

(Shared memory is no path under vLLM: a worker's KV cache is its private memory, so each backend
takes its path across hosts.) One P/D pair per
backend (``pairs``: its metastore, vLLM prefill, vLLM decode and proxy; every prefill on the
prefills' half of the cores, every decode on the other; ``Pair.prefill_config``: the
``--kv-transfer-config`` its prefill was started with) starts side by side. Per round the same
fresh prompt goes through each pair in turn (``backend_round``): its TTFT, TPOT and tokens
(``kvoffload_bench.vllm_stream.timed_round``), and around it the decode's pull counters and a
memcpy sampled under the same load (``kvoffload_bench.pd_memcpy.MemcpySampler``, one pull's bytes:
a layer's blocks of the prompt). Per backend (``figures``): ``gbps_in_stack`` (the decode's
``bytes_read`` over ``read_ms_total``, median over the rounds), ``memcpy_gbps``, ``ratio_to_memcpy``
(median of the rounds' ratios), ``reads`` and ``path_checked`` (every read of every round the
path's own: ``reads_streamed`` or ``reads_engine``; else no rate: None), ``requests_pulled`` /
``requests_failed`` (the decode's ``requests_pulled_total`` / ``requests_failed_total``, deltas over
the rounds: a decode recomputes a prompt whose pull failed, so its tokens cannot tell),
``pd_ttft_ratio`` / ``pd_tpot_ratio`` (median over the rounds of the round's TTFT / TPOT over the
plain server's same round; the TPOT ratio None, and ``pd_tpot_ratio_not_measured`` the reason, when
the two sides' TPOTs come from different sources: ``vllm_stream.tpot_sources_differ``) and
``tokens_equal`` (every round's tokens the plain server's).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvcore.transferregistry import TRANSFERS, VLLM_TRANSFERS
from kvoffload_bench.pd_memcpy import MemcpySampler
from kvoffload_bench.pd_report import _measured_median, pull_figures
from kvoffload_bench.vllm_stream import settled, timed_round, tpot_sources_differ

if TYPE_CHECKING:
    from kvoffload_testing.vllm_server import Proxy, VllmServer

# path -> (the connectors' transfer_backend, the decode's counter of the path's reads)
BACKENDS = {
    path.name: (name, path.counter) for name in VLLM_TRANSFERS if (path := TRANSFERS[name].across_hosts) is not None
}
CONSUMER = "vllm:kvoffload_d2h_consumer_{}_total"
PULL = ("bytes_read", "read_ms_total", "reads_streamed", "reads_engine", "reads_shared_memory")
REQUESTS = ("bytes_read", "requests_pulled", "requests_failed")  # a decode's, deltas over all the rounds


@dataclass(frozen=True)
class Pair:
    """One backend's running P/D pair."""

    backend: str
    prefill: VllmServer
    decode: VllmServer
    proxy: Proxy
    prefill_config: str  # the prefill's --kv-transfer-config, as sent


@contextlib.contextmanager
def pairs(
    model_dir: Path, work: Path, max_len: int, prefill_env: dict, decode_env: dict, backends: tuple[str, ...]
) -> Iterator[dict[str, Pair]]:
    """A running P/D pair per backend of ``backends`` (keys of ``BACKENDS``), all started side by side;
    stopped on leaving."""
    from kvoffload_testing.ports import free_stack_ports
    from kvoffload_testing.vllm_server import Metastore, Proxy, VllmServer, free_port, running
    from kvoffload_testing.vllm_stack import vllm_decode_transfer_config, vllm_prefill_transfer_config

    ports = free_stack_ports(len(backends), len(backends))  # decode i's control port: kv_port + 16 i

    def server(name: str, port: int, env: dict, kv_transfer_config: str) -> VllmServer:
        return VllmServer(
            model_dir,
            port=port,
            max_model_len=max_len,
            env=env,
            log_path=work / f"{name}.log",
            start_timeout_s=300,
            extra_args=["--kv-transfer-config", kv_transfer_config],
        )

    with contextlib.ExitStack() as stack:
        servers, configs = [], []
        for i, backend in enumerate(backends):
            transfer = BACKENDS[backend][0]
            ms = stack.enter_context(Metastore(work / f"{backend}-metastore.log"))
            prefill_config = vllm_prefill_transfer_config(ms.address, transfer_backend=transfer)
            decode_config = vllm_decode_transfer_config(ports["kv_port"] + 16 * i, transfer)
            configs.append(prefill_config)
            servers.append(server(f"{backend}-prefill", ports["prefill_ports"][i], prefill_env, prefill_config))
            servers.append(server(f"{backend}-decode", ports["decode_ports"][i], decode_env, decode_config))
        stack.enter_context(running(*servers))
        out = {}
        for i, backend in enumerate(backends):
            prefill, decode = servers[2 * i], servers[2 * i + 1]
            port = ports["proxy_port"] if i == 0 else free_port()
            proxy = stack.enter_context(Proxy(port, prefill.port, decode.port, work / f"{backend}-proxy.log"))
            out[backend] = Pair(backend, prefill, decode, proxy, configs[i])
        yield out


def backend_round(pair: Pair, name: str, r: int, prompt_tokens: int, max_tokens: int, sampler: MemcpySampler) -> dict:
    """Round ``r``'s prompt through ``pair``: its ``timed_round`` (``timed``), the decode's pull figures
    against the memcpy sampled meanwhile, and the reads of each path (``reads``)."""
    names = [CONSUMER.format(c) for c in PULL]
    before = settled(pair.decode.url, names)
    done = threading.Event()
    memcpy = sampler.start(done)
    try:
        timed = timed_round(pair.proxy.url, name, r, prompt_tokens, max_tokens, pair.decode.url)
    finally:
        done.set()
    memcpy_gbps, copies = memcpy()
    after = settled(pair.decode.url, names)
    delta = {c: after[n] - before[n] for c, n in zip(PULL, names, strict=True)}
    figures = pull_figures({"bytes_read": 0, "read_ms_total": 0}, delta, memcpy_gbps, copies)
    return {"timed": timed, **figures, "reads": {c: int(delta[c]) for c in PULL[2:]}}


def figures(by_backend: dict[str, list[dict]], plain_rounds: list[dict], requests: dict[str, dict]) -> dict:
    """``pull_by_backend`` and ``tokens_equal_by_backend`` from each backend's rounds, the plain
    server's rounds on the same prompts and each decode's ``REQUESTS`` deltas over the rounds
    (``requests``, by backend; module docstring)."""
    out = {}
    for backend, rounds in by_backend.items():
        counter = BACKENDS[backend][1]
        checked = all(r["reads"][counter] > 0 and sum(r["reads"].values()) == r["reads"][counter] for r in rounds)
        rates = {
            key: _measured_median([r[key] for r in rounds]) if checked else None
            for key in ("pull_gbps_in_stack", "memcpy_gbps_in_stack", "pull_gbps_in_stack_ratio_to_memcpy")
        }
        pairs_ = list(zip(rounds, plain_rounds, strict=True))
        why = tpot_sources_differ({"plain": plain_rounds, f"P/D {backend}": [r["timed"] for r in rounds]})
        out[backend] = {
            "gbps_in_stack": rates["pull_gbps_in_stack"],
            "memcpy_gbps": rates["memcpy_gbps_in_stack"],
            "ratio_to_memcpy": rates["pull_gbps_in_stack_ratio_to_memcpy"],
            "reads": sum(r["reads"][counter] for r in rounds),
            "path_checked": checked,
            "requests_pulled": int(requests[backend]["requests_pulled"]),
            "requests_failed": int(requests[backend]["requests_failed"]),
            "pd_ttft_ratio": statistics.median(d["timed"]["ttft_s"] / p["ttft_s"] for d, p in pairs_),
            "pd_tpot_ratio": None if why else statistics.median(d["timed"]["tpot_s"] / p["tpot_s"] for d, p in pairs_),
            "pd_tpot_ratio_not_measured": why,
            "tokens_equal": all(d["timed"]["tokens"] == p["tokens"] for d, p in pairs_),
            "per_round": [{k: v for k, v in r.items() if k != "timed"} | _timing(r["timed"]) for r in rounds],
        }
    return {"pull_by_backend": out, "tokens_equal_by_backend": all(b["tokens_equal"] for b in out.values())}


def _timing(timed: dict) -> dict:
    return {k: timed[k] for k in ("ttft_s", "tpot_s", "tpot_source")}
