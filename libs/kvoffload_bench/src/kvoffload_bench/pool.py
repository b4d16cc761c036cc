"""Pool bench: put/get throughput of each host-pool backend, as a ratio to a memcpy timed next to it.

Two object shapes: ``kv_block`` — one block of 64 token rows of 576 bytes (DeepSeek's MLA latent
row in bf16: 36 KiB), 512 of them per batch; and ``1mib`` — objects of 1 MiB (64 rows of 16 KiB),
32 per batch. Per backend and shape:

- ``put``: ``alloc`` + ``put_from`` of a fresh batch of keys, in this process;
- ``get``: ``get_into`` of that batch, in this process (single-process), into one destination
  buffer reused across the runs (as memcpy's: a fresh buffer's first touch costs as much as the copy);
- ``get_cross_process``: ``get_into`` of the same keys by a second process with its own client
  (how a decode or another prefill reads a pool it does not own).

Each run of each is timed right after a plain ``memcpy`` (``torch`` copy) of the same bytes, in the
same process (the reader's in the reader), so every backend and shape is compared with copies made
under the load of its own moment (the machine is shared: absolute rates mean little, and a memcpy
timed once up front would judge a later backend by another moment's load). Reported: ``*_gbps``
(the median run), ``*_memcpy_gbps`` (the median of the memcpys next to them), ``*_ratio`` (the median
over the runs of each run's rate over its own memcpy's) and ``*_runs_s`` (each run's [seconds, its
memcpy's seconds]), over ``repeats`` runs.

Goals (``goals`` / ``goals_met``): the embedded pool's put and get of 1 MiB objects at
``GOAL_RATIO_TO_MEMCPY`` of a memcpy or better (a DeepSeek-V3.2 prefill saves ~290 MB per
4K-token request: the save must not set its pace). A run without the ``1mib`` shape, or without the
embedded pool, cannot judge them: they are unmet, and ``not_measured`` says why. Puts write whole
blocks with one memcpy each (``kvcore.hotcache.gather.scatter_blocks``): torch's ``index_copy_`` of 1 MiB
blocks ran at a seventh of a memcpy here.

Backends (``backends`` in the JSON): one entry per ``kvcore.pool.registry`` backend, its pools opened
by its factory and its server started by its launcher; one whose probe fails here
(``kvcore.backends``) is ``{"available": false, "reason": ...}``:

- ``kvoffload``: the embedded pool — ``LocalHostPool`` for the single-process figures, and a
  ``RemoteHostPool`` registered with a real ``kvoffload-metastore`` for the cross-process read
  (the reader attaches the writer's shared-memory segment);
- ``mooncake``: ``MooncakeHostPool`` against a real ``mooncake_master`` on loopback (TCP), the
  reader a second store client in another process;
- ``memcache``: ``MemcacheHostPool`` against a real Memcache MetaService started here, the reader
  another LocalService process — where its data path runs (an Ascend host with its driver); elsewhere
  its entry is ``{"available": false, "reason": ...}`` with the reason memcache_hybrid itself gave
  (or why it is not installed).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, cast

import torch

from kvcore.pool.geometry import PoolGeometry

if TYPE_CHECKING:
    from poolbackends.memcache_meta import MemcacheMetaService
    from poolbackends.metastore_server import MetastoreServer
    from poolbackends.mooncake_master import MooncakeMaster

SHAPES = {"kv_block": (64, 576, 512), "1mib": (64, 16384, 32)}  # name -> (rows, row bytes, objects per batch)
GOAL_RATIO_TO_MEMCPY = 0.5
GOALS = ("kvoffload_1mib_put_ratio", "kvoffload_1mib_get_ratio")


def run(*, repeats: int = 5, shapes: tuple[str, ...] = tuple(SHAPES)) -> dict:
    """The bench (module docstring); ``shapes`` narrows the object shapes (tests use one)."""
    from kvcore.backends import backend_problem
    from kvcore.pool.registry import POOL_BACKENDS
    from svcruntime.logs import quiet_logs

    quiet_logs()  # the pools' info logs are dropped, their warnings go to stderr: stdout is the JSON's
    backends: dict[str, dict] = {}
    with ExitStack() as stack:
        for name in POOL_BACKENDS:  # each backend its entry: why it cannot run here, or its figures
            problem = backend_problem(name)
            backends[name] = (
                {"available": False, "reason": problem} if problem else MEASURES[name](stack, shapes, repeats)
            )
    return {
        "bench": "pool",
        "repeats": repeats,
        "shapes": {n: _shape_info(n) for n in shapes},
        "backends": backends,
        **_goals(backends.get("kvoffload", {})),
    }


def _goals(embedded: dict) -> dict:
    """``goals``, ``goals_met`` and, for a goal this run could not judge, ``not_measured``."""
    figures = embedded.get("1mib") or {}
    met, why = {}, {}
    for goal in GOALS:
        figure = figures.get(goal.removeprefix("kvoffload_1mib_"))
        met[goal] = figure is not None and figure >= GOAL_RATIO_TO_MEMCPY
        if figure is None:
            why[goal] = "the 1mib shape was not run" if embedded.get("available") else "the embedded pool did not run"
    out = {"goals": dict.fromkeys(GOALS, GOAL_RATIO_TO_MEMCPY), "goals_met": met}
    return out | ({"not_measured": why} if why else {})


def _shape_info(name: str) -> dict:
    rows, row_bytes, count = SHAPES[name]
    return {"rows": rows, "row_bytes": row_bytes, "object_bytes": rows * row_bytes, "objects": count}


def _geometry(name: str) -> PoolGeometry:
    """Room for two batches of ``name`` (one is in the pool at a time)."""
    rows, row_bytes, count = SHAPES[name]
    return PoolGeometry(rows, (row_bytes,), 2 * count)


def _batch(name: str, seed: int) -> torch.Tensor:
    rows, row_bytes, count = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, rows, row_bytes), dtype=torch.uint8, generator=g)


def _copy_s(dst: torch.Tensor, src: torch.Tensor) -> float:
    """Seconds of one memcpy of ``src`` into ``dst``."""
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def _figures(op: str, nbytes: int, runs: list[tuple[float, float]]) -> dict:
    """``op``'s figures from its runs, each (seconds, seconds of the memcpy of the same ``nbytes``
    timed next to it): the median rates and the median of the runs' ratios to their own memcpy."""
    return {
        f"{op}_gbps": nbytes / statistics.median(s for s, _ in runs) / 1e9,
        f"{op}_memcpy_gbps": nbytes / statistics.median(m for _, m in runs) / 1e9,
        f"{op}_ratio": statistics.median(m / s for s, m in runs),
        f"{op}_runs_s": [[s, m] for s, m in runs],
    }


def _measure(pool, name: str, repeats: int, read_elsewhere: Callable[[list[bytes]], list] | None) -> dict:
    """put / get (and the cross-process get) of one shape on one pool, each run right after a memcpy
    of the same bytes."""
    src = _batch(name, 1)
    nbytes = src.numel()
    runs: dict[str, list[tuple[float, float]]] = {"put": [], "get": []}
    keys: list[bytes] = []
    dst = torch.empty_like(src)  # one destination, as memcpy's: a fresh one would time its page faults
    copy_dst = torch.empty_like(src)
    copy_dst.copy_(src)  # the memcpy's destination touched once, untimed: no run pays its page faults
    for r in range(repeats):  # a fresh batch each time (objects are write-once), dropped after
        keys = [f"bench-{name}-{r}-{i}-{uuid.uuid4().hex[:6]}".encode() for i in range(src.shape[0])]
        memcpy_s = _copy_s(copy_dst, src)
        t0 = time.perf_counter()
        pool.alloc(keys)
        pool.put_from(keys, 0, src)
        runs["put"].append((time.perf_counter() - t0, memcpy_s))
        dst.zero_()  # nothing of the last get left to pass the check below
        memcpy_s = _copy_s(copy_dst, src)
        t0 = time.perf_counter()
        pool.get_into(keys, 0, dst)
        runs["get"].append((time.perf_counter() - t0, memcpy_s))
        if not torch.equal(dst, src):
            raise AssertionError(f"{type(pool).__name__} returned other bytes than it was given ({name})")
        if r < repeats - 1:
            pool.remove(keys)
    out = {k: v for op, op_runs in runs.items() for k, v in _figures(op, nbytes, op_runs).items()}
    if read_elsewhere is not None:  # the last batch stays (the caller closes the pool): a reader's
        out |= _figures("get_cross_process", nbytes, read_elsewhere(keys))  # Mooncake lease outlives it
    return out


def _child(mode: str, args: dict, what: str) -> str:
    """Runs ``python -m kvoffload_bench.pool MODE JSON`` (a reader or the memcache probe) and returns
    its stdout; a non-zero exit raises with the end of its stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload_bench.pool", mode, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ.copy(),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the {what} process failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def _reader(backend: str, name: str, repeats: int, **keys) -> Callable[[list[bytes]], list]:
    """A second process with a pool of its own (store keys ``keys``) that reads ``keys`` ``repeats``
    times, each read right after a memcpy of the same bytes there, and answers each read's
    (seconds, its memcpy's seconds)."""

    def read(object_keys: list[bytes]) -> list:
        args = {
            "backend": backend,
            "shape": name,
            "repeats": repeats,
            "keys": [k.hex() for k in object_keys],
            "store_keys": keys,
        }
        runs = json.loads(_child("read", args, f"{backend} reader").strip().splitlines()[-1])["runs_s"]
        return [(float(s), float(m)) for s, m in runs]

    return read


def _pool(backend: str, shape: str, keys: Mapping[str, Any] | None = None, geometry: PoolGeometry | None = None):
    """A pool of ``backend`` (its ``kvcore.pool.registry`` factory) for ``shape``, its store keys ``keys``
    (raw ``kv_connector_extra_config`` keys, as a connector config's JSON holds them)."""
    from kvcore.config.connectors import StoreConnectorConfig
    from poolbackends.registry import PoolRequest, open_pool

    tag = uuid.uuid4().hex[:8]
    store = StoreConnectorConfig(backend=backend, **(keys or {}))
    return open_pool(PoolRequest(store, geometry or _geometry(shape), f"kvoffload-bench-{tag}", f"bench-{tag}"))


def _kvoffload(stack: ExitStack, shapes, repeats: int) -> dict:
    """The embedded pool: kept in this process for the single-process figures, indexed by a real
    metastore for the cross-process read."""
    from poolbackends.registry import start_server

    server = cast("MetastoreServer", start_server("kvoffload"))  # the launcher kvcore.pool.registry names
    stack.callback(server.stop)
    target = server.address
    out = {
        "available": True,
        "single_process_pool": "LocalHostPool",
        "cross_process_pool": "RemoteHostPool",
        "metastore": target,
    }
    for name in shapes:
        with _pool("kvoffload", name) as local:
            single = _measure(local, name, repeats, None)
        with _pool("kvoffload", name, {"metastore": target}) as remote:
            cross = _measure(remote, name, repeats, _reader("kvoffload", name, repeats, metastore=target))
        out[name] = {**single, **{k: v for k, v in cross.items() if "cross_process" in k}}
    return out


def _mooncake(stack: ExitStack, shapes, repeats: int) -> dict:
    from poolbackends.registry import start_server

    try:
        master = cast("MooncakeMaster", start_server("mooncake"))  # the launcher kvcore.pool.registry names
    except Exception as exc:  # noqa: BLE001 - not installed here (scripts/install-mooncake), or the master cannot start
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    stack.callback(master.stop)
    out = {"available": True, "master": master.address, "transport": "tcp (loopback)"}
    for name in shapes:
        keys = {"mooncake_master": master.address, "mooncake_namespace": f"bench-{uuid.uuid4().hex[:8]}"}
        with _pool("mooncake", name, keys) as pool:
            out[name] = _measure(pool, name, repeats, _reader("mooncake", name, repeats, **keys))
    return out


def _memcache(stack: ExitStack, shapes, repeats: int) -> dict:
    """Memcache's entry: its pool is built for real, in a process of its own (memcache_hybrid keeps
    one LocalService per process), against a real MetaService; where memcache_hybrid refuses to
    start (no Ascend driver), the entry is the reason it gave."""
    from poolbackends.registry import start_server

    meta = cast("MemcacheMetaService", start_server("memcache"))  # the launcher kvcore.pool.registry names
    stack.callback(meta.stop)
    args = {"shape": shapes[0], "meta_service_url": meta.meta_service_url, "config_store_url": meta.config_store_url}
    out = _child("memcache", args, "memcache probe")
    # the library logs on stdout too, even as the process exits: the entry is the line the probe printed
    entries = [line for line in out.splitlines() if line.startswith('{"available": ')]
    if len(entries) != 1:
        raise RuntimeError(f"the memcache probe printed {len(entries)} entries: {out.strip()[-2000:]}")
    return json.loads(entries[0])


MEASURES = {"kvoffload": _kvoffload, "memcache": _memcache, "mooncake": _mooncake}  # one per registry backend


def _memcache_main(args: dict) -> None:
    """The memcache probe process: builds the pool; prints its entry."""
    from poolbackends.memcache import MemcacheHostPool
    from poolbackends.memcache_client import MemcacheUnavailable
    from poolbackends.memcache_conf import LocalSettings

    settings = LocalSettings(args["meta_service_url"], args["config_store_url"], dram_bytes=1, protocol="host_shm")
    try:
        pool = MemcacheHostPool.connect(_geometry(args["shape"]), settings=settings)
    except MemcacheUnavailable as exc:
        entry = {"available": False, "reason": f"memcache_hybrid cannot start a LocalService here: {exc.reason}"}
    else:
        pool.close()  # it started: an Ascend host; its figures are not measured by this bench yet
        entry = {
            "available": False,
            "reason": "memcache_hybrid started a LocalService here, but this bench does "
            "not measure the memcache pool yet",
        }
    print(json.dumps(entry))


def _read_main(args: dict) -> None:
    """The reader process: its own pool of the backend, ``get_into`` of the keys, each right after a
    memcpy of the same bytes in this process; prints each read's [seconds, its memcpy's seconds]."""
    name, keys = args["shape"], [bytes.fromhex(k) for k in args["keys"]]
    rows, row_bytes, _ = SHAPES[name]
    dst = torch.zeros(len(keys), rows, row_bytes, dtype=torch.uint8)  # touched, as the memcpy's buffers
    copy_src, copy_dst = torch.ones_like(dst), torch.zeros_like(dst)
    with _pool(args["backend"], name, args["store_keys"], PoolGeometry(rows, (row_bytes,), 1)) as pool:
        runs = []
        for _ in range(args["repeats"]):
            memcpy_s = _copy_s(copy_dst, copy_src)
            t0 = time.perf_counter()
            pool.get_into(keys, 0, dst)
            runs.append([time.perf_counter() - t0, memcpy_s])
    print(json.dumps({"runs_s": runs}))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("read", "memcache"):
        raise SystemExit(
            "usage: python -m kvoffload_bench.pool read|memcache JSON (the bench's reader process, its memcache probe)"
        )
    (_read_main if sys.argv[1] == "read" else _memcache_main)(json.loads(sys.argv[2]))
