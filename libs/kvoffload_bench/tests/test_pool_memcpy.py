"""``kvoffload bench pool`` judges each backend against a memcpy timed next to its own runs: on a machine
whose load changes between one backend and the next, every backend's ratio stays what it is here.

``run`` is driven whole with the pools replaced (no server starts): each fake pool's put and get
are one copy of the batch (so its true ratio to memcpy is about 1), and the bench's clock
(``pool.time``) runs ``SLOWDOWN`` times faster than the real one from the moment the Mooncake
backend's server starts, as if another job had taken the machine then: every copy made after it
looks that much slower, the memcpys next to Mooncake's runs included."""

from __future__ import annotations

import statistics
import time
import types
from contextlib import contextmanager

import pytest
import torch

from kvoffload_bench import pool as bench_pool

SLOWDOWN = 100.0


class _Clock:
    """``time.perf_counter`` whose seconds count ``factor`` times each real second."""

    def __init__(self) -> None:
        self.factor, self.real, self.seen = 1.0, time.perf_counter(), 0.0

    def perf_counter(self) -> float:
        now = time.perf_counter()
        self.seen += (now - self.real) * self.factor
        self.real = now
        return self.seen


class _Pool:
    """A pool of one batch: its put and get are a copy each."""

    def __init__(self, shape: str) -> None:
        rows, row_bytes, count = bench_pool.SHAPES[shape]
        self.store = torch.zeros(count, rows, row_bytes, dtype=torch.uint8)  # touched: no page faults timed

    def alloc(self, keys) -> None:
        return None

    def put_from(self, keys, start: int, src: torch.Tensor) -> None:
        self.store.copy_(src)

    def get_into(self, keys, start: int, dst: torch.Tensor) -> None:
        dst.copy_(self.store)

    def remove(self, keys) -> None:
        return None


@pytest.fixture
def machine(monkeypatch):
    """The pools, servers and clock replaced; memcache cannot run, and no second process reads. Returns
    the clock."""
    import kvcore.backends
    import poolbackends.registry
    import svcruntime.logs

    clock = _Clock()

    def start_server(name: str):
        if name == "mooncake":
            clock.factor = SLOWDOWN  # another job takes the machine from here on
        return types.SimpleNamespace(stop=lambda: None, address=f"127.0.0.1:1{len(name)}")

    @contextmanager
    def pool(backend: str, shape: str, keys=None, geometry=None):
        yield _Pool(shape)

    monkeypatch.setattr(bench_pool, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(poolbackends.registry, "start_server", start_server)
    monkeypatch.setattr(kvcore.backends, "backend_problem", lambda name: "not here" if name == "memcache" else None)
    monkeypatch.setattr(bench_pool, "_pool", pool)
    monkeypatch.setattr(bench_pool, "_reader", lambda *a, **kw: None)  # no cross-process read (a test may add one)
    monkeypatch.setattr(svcruntime.logs, "quiet_logs", lambda: None)  # this process's logging stays as it is
    return clock


def test_a_backend_measured_after_the_machine_slowed_is_judged_by_the_memcpys_next_to_it(machine):
    r = bench_pool.run(repeats=7, shapes=("kv_block",))
    embedded, mooncake = r["backends"]["kvoffload"]["kv_block"], r["backends"]["mooncake"]["kv_block"]
    assert r["backends"]["memcache"] == {"available": False, "reason": "not here"}
    for op in ("put", "get"):  # a copy against a copy, each at the load of its own moment: about 1
        for figures in (embedded, mooncake):  # (a memcpy of the machine before the slowdown: about 0.01)
            assert 0.2 < figures[f"{op}_ratio"] < 5, (op, figures)
        # the memcpys next to Mooncake's runs saw the slower machine
        assert mooncake[f"{op}_memcpy_gbps"] < embedded[f"{op}_memcpy_gbps"] / 10, (op, embedded, mooncake)


def test_each_ratio_is_the_median_of_the_runs_ratios_to_their_own_memcpy(machine, monkeypatch):
    def reader(backend: str, shape: str, repeats: int, **keys):
        def read(object_keys: list[bytes]) -> list[tuple[float, float]]:  # the reader's [seconds, memcpy's]
            src, dst = _Pool(shape).store, _Pool(shape).store
            return [(bench_pool._copy_s(dst, src), bench_pool._copy_s(dst, src)) for _ in range(repeats)]

        return read

    monkeypatch.setattr(bench_pool, "_reader", reader)
    r = bench_pool.run(repeats=3, shapes=("kv_block",))
    nbytes = r["shapes"]["kv_block"]["object_bytes"] * r["shapes"]["kv_block"]["objects"]
    for backend in ("kvoffload", "mooncake"):
        figures = r["backends"][backend]["kv_block"]
        for op in ("put", "get", "get_cross_process"):
            runs = figures[f"{op}_runs_s"]
            assert len(runs) == 3 and all(s > 0 and m > 0 for s, m in runs), runs
            assert figures[f"{op}_ratio"] == pytest.approx(statistics.median(m / s for s, m in runs))
            assert figures[f"{op}_gbps"] == pytest.approx(nbytes / statistics.median(s for s, _ in runs) / 1e9)
            assert figures[f"{op}_memcpy_gbps"] == pytest.approx(nbytes / statistics.median(m for _, m in runs) / 1e9)
    assert "memcpy_gbps" not in r  # no memcpy of another moment to judge by
