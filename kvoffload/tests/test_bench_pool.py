"""kvoffload bench pool: every backend has its entry, the measured ones read back what they were
given in this process and in another one, and the figures are ratios to memcpy of the same run."""

from __future__ import annotations

import pytest

from kvoffload.bench_pool import SHAPES, run


def test_pool_bench_measures_the_embedded_pool_and_mooncake_and_names_why_memcache_cannot_run():
    r = run(repeats=2, shapes=("kv_block",))
    assert r["bench"] == "pool" and set(r["backends"]) == {"kvoffload", "mooncake", "memcache"}
    rows, row_bytes, count = SHAPES["kv_block"]
    assert r["shapes"]["kv_block"] == {"rows": rows, "row_bytes": row_bytes, "object_bytes": rows * row_bytes,
                                       "objects": count}
    memcpy = r["memcpy_gbps"]["kv_block"]
    assert memcpy > 0
    for name in ("kvoffload", "mooncake"):  # make test installs Mooncake: both must have run
        b = r["backends"][name]
        assert b["available"] is True, b
        fig = b["kv_block"]
        for op in ("put", "get", "get_cross_process"):
            assert fig[f"{op}_gbps"] > 0
            assert fig[f"{op}_ratio"] == pytest.approx(fig[f"{op}_gbps"] / memcpy)
    memcache = r["backends"]["memcache"]
    assert memcache["available"] is False and memcache["reason"]  # no Ascend NPU here: the exact reason
