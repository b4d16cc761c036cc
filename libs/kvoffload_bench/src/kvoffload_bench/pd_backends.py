"""``bench pd``'s ``pull_by_backend``: the decode's pull rate in the stack on each P→D data path, each
against a memcpy sampled under the same load, the paths taking turns round by round.

The paths are those of the transfer backends a loopback stack runs (``kvcore.transferregistry``:
each entry's ``PullPath`` on one host and across hosts, once each; ``stack_paths``):

- ``shared_memory``: transfer_backend "kvoffload", prefill and decode on one host id: the decode
  copies the rows straight out of the prefill's shared-memory layer buffers;
- ``grpc_stream``: transfer_backend "kvoffload", the decode given another host id
  (``KVOFFLOAD_HOST_ID``): it streams the rows from the prefill's LayerSource, as across hosts;
- ``mooncake``: transfer_backend "mooncake": every layer read through Mooncake Transfer Engine (TCP).

One stack per path runs, side by side. Each round sends the same ``requests`` fresh prompts
through each stack in turn (completions, not streamed: a request ends after every layer was
pulled); around each, the decode's pull counters and the memcpy sampler (``MemcpySampler``, the one
``bench pd`` uses). Per path: ``gbps_in_stack`` (bytes_read over read_ms_total, median over the
rounds), ``memcpy_gbps`` (median) and ``ratio_to_memcpy`` (the median of the rounds' ratios);
``reads`` (the counter of the path's reads: ``reads_shared_memory``, ``reads_streamed``,
``reads_engine``) and ``path_checked`` (every read of every round went that way). A path whose
reads went another way has no figures (None). ``tokens_equal_by_backend``: the three paths gave
the same greedy tokens for every prompt.

``pull_across_namespaces`` (``across_namespaces``): the same rounds on each stack backend's path
across hosts, with the decode in a network namespace of its own behind a veth pair
(``kvoffload_testing.netns``: every byte crosses a real network stack), ``mooncake`` and
``grpc_stream`` side by side, and
``mooncake_to_grpc_stream``, the ratio of their ``gbps_in_stack`` (goal >= 2); with
``tokens_equal_across_namespaces``. Network namespaces need root: without it (or without ``ip``)
the part raises, naming why.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kvcore.transferregistry import TRANSFERS
from kvoffload_bench.pd_memcpy import MemcpySampler
from kvoffload_bench.pd_report import _measured_median, pull_figures

CHUNK_SIZE = 2048  # prefill chunk, both halves: the decode pulls a layer's rows one chunk at a time


def bench_stack_config(model_dir: Path, log_dir: Path, block_size: int, prefill_args: Sequence[str] = (), **fields):
    """The stack every ``bench pd`` round runs on (ports free now; the prefill's chunk ``CHUNK_SIZE``
    and ``prefill_args``), with ``fields`` of ``StackConfig`` on top."""
    from kvoffload_testing.ports import free_stack_ports
    from kvoffload_testing.stack import StackConfig

    return StackConfig(
        model=model_dir,
        log_dir=log_dir,
        **free_stack_ports(),
        max_model_len=8192,
        block_size=block_size,
        service_args={"prefill-0": ["--chunk-size", str(CHUNK_SIZE), *prefill_args]},
        **fields,
    )


OTHER_HOST: dict = {"service_env": {"decode-0": {"KVOFFLOAD_HOST_ID": "bench-pd-other-host"}}}


def stack_paths(*, one_host: bool) -> dict[str, tuple[dict, str]]:
    """Path name -> (StackConfig fields, the decode's counter of the path's reads), for every transfer
    backend a stack runs: with ``one_host`` each path on one host, then (the decode given another host
    id) each path across hosts that is not that one; else the paths across hosts alone."""
    out: dict[str, tuple[dict, str]] = {}
    for backend in (b for b in TRANSFERS.values() if b.stack):
        here = {"transfer": backend.name}
        paths = [(backend.one_host, here)] if one_host else []
        for path, fields in (*paths, (backend.across_hosts, {**here, **OTHER_HOST})):
            if path is not None and path.name not in out:
                out[path.name] = (fields, path.counter)
    return out


BACKENDS = stack_paths(one_host=True)
# the paths across hosts, the decode in a namespace of its own (and another host id)
ACROSS = stack_paths(one_host=False)
READ_COUNTERS = tuple(dict.fromkeys(counter for _, counter in BACKENDS.values()))


def by_backend(model_dir: Path, log_dir: Path, **sizes: Any) -> dict:
    """``pull_by_backend`` and ``tokens_equal_by_backend`` (module docstring); ``sizes``: ``_paths``'s."""
    from kvoffload_testing.stack import Stack

    by, equal = _paths(BACKENDS, Stack, model_dir, log_dir, **sizes)
    return {"pull_by_backend": by, "tokens_equal_by_backend": equal}


def across_namespaces(model_dir: Path, log_dir: Path, **sizes: Any) -> dict:
    """``pull_across_namespaces`` and ``tokens_equal_across_namespaces`` (module docstring); ``sizes``:
    ``_paths``'s."""
    from kvoffload_testing.netns import SplitStack, veth_namespace

    with veth_namespace() as veth:
        paths = {name: ({**fields, "host": veth.here}, counter) for name, (fields, counter) in ACROSS.items()}
        by, equal = _paths(paths, lambda cfg: SplitStack(cfg, veth), model_dir, log_dir, **sizes)
    mooncake, grpc_stream = by["mooncake"]["gbps_in_stack"], by["grpc_stream"]["gbps_in_stack"]
    ratio = mooncake / grpc_stream if mooncake is not None and grpc_stream else None
    return {"pull_across_namespaces": {**by, "mooncake_to_grpc_stream": ratio}, "tokens_equal_across_namespaces": equal}


def _paths(
    paths: dict[str, tuple[dict, str]],
    make_stack: Callable,
    model_dir: Path,
    log_dir: Path,
    *,
    requests: int,
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    rounds: int,
    gen: random.Random,
    sampler: MemcpySampler,
) -> tuple[dict, bool]:
    """Each path of ``paths`` (name -> (StackConfig fields, its reads' counter)) in a stack of its own
    (``make_stack(cfg)``), all side by side, the same prompts on each in turn, round by round: each
    path's ``_figures`` and whether every path gave the same tokens."""
    per_round: dict[str, list[dict]] = {name: [] for name in paths}
    tokens_equal = True
    with contextlib.ExitStack() as stacks, cf.ThreadPoolExecutor(requests) as pool:
        running = {}
        for name, (fields, _) in paths.items():  # one after another: each takes ports free now
            cfg = bench_stack_config(model_dir, log_dir / name, block_size, **fields)
            running[name] = stacks.enter_context(make_stack(cfg))
        for _ in range(rounds):
            prompts = [[gen.randrange(256) for _ in range(prompt_tokens)] for _ in range(requests)]
            answers = {
                name: _round(stack, pool, prompts, max_tokens, sampler, per_round[name])
                for name, stack in running.items()
            }
            tokens_equal &= len({tuple(map(tuple, a)) for a in answers.values()}) == 1
    return {name: _figures(per_round[name], paths[name][1]) for name in paths}, tokens_equal


def _round(stack, pool, prompts, max_tokens: int, sampler: MemcpySampler, out: list[dict]) -> list[list[int]]:
    """One round on ``stack``: the prompts at once, the decode's counters and the memcpy around them."""
    import threading
    from functools import partial

    from kvoffload_testing.stack_client import grpc_stats, post_json

    decode = f"{urlparse(stack.http_url('decode-0')).hostname}:{stack.cfg.decode_control_port(0)}"
    before = grpc_stats(decode)
    done = threading.Event()
    memcpy = sampler.start(done)
    body = partial(
        lambda url, p: post_json(url, {"prompt": p, "max_tokens": max_tokens, "temperature": 0}),
        f"{stack.url}/v1/completions",
    )
    try:
        answers = [a["choices"][0]["token_ids"] for a in pool.map(body, prompts)]
    finally:
        done.set()
    memcpy_gbps, copies = memcpy()
    after = grpc_stats(decode)
    reads = {c: int(after[c] - before[c]) for c in READ_COUNTERS}
    out.append(pull_figures(before, after, memcpy_gbps, copies) | {"reads": reads})
    return answers


def _figures(rounds: list[dict], counter: str) -> dict:
    checked = all(r["reads"][counter] > 0 and sum(r["reads"].values()) == r["reads"][counter] for r in rounds)
    med = (lambda key: _measured_median([r[key] for r in rounds])) if checked else (lambda key: None)
    return {
        "gbps_in_stack": med("pull_gbps_in_stack"),
        "memcpy_gbps": med("memcpy_gbps_in_stack"),
        "ratio_to_memcpy": med("pull_gbps_in_stack_ratio_to_memcpy"),
        "reads": sum(r["reads"][counter] for r in rounds),
        "path_checked": checked,
        "per_round": rounds,
    }
