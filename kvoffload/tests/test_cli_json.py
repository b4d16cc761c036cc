"""Every ``kvoffload`` command with ``--json`` prints exactly one JSON document on stdout, its logs on
stderr, as a script reading stdout needs: each runs in its own process here and its whole stdout
goes through ``json.loads``. The benches run through the CLI's own path (``cli.main``) with small
sizes given to the bench function; ``bench pool`` is the one whose servers and native libraries
logged on stdout."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvoffload.cli import build_parser
from kvoffload_bench.pool import SHAPES

KVOFFLOAD = Path(sys.executable).with_name("kvoffload")


def _json_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The subcommands (as argv prefixes) that take ``--json``, from the parser's tree."""
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if any("--json" in a.option_strings for a in sub._actions):
                    found.add((*path, name))
                found |= _json_commands(sub, (*path, name))
    return found


def _driven(code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """``code`` (it ends by calling the CLI) in a fresh Python process, as a user's shell runs it
    (``_user_env``); stdout and stderr captured apart."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=_user_env()
    )


def _user_env() -> dict[str, str]:
    """This environment without PYTHONUNBUFFERED (which also unbuffers C stdio), as a user's shell has it."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


def test_the_commands_that_take_json_are_the_ones_tested_here():
    assert _json_commands(build_parser()) == {("bench",), ("plan",)}  # a new one gets its test below


def test_plan_json_prints_one_json_document(tmp_path):
    from dsamodel.presets import tiny_config

    tiny_config().to_json(tmp_path / "config.json")
    proc = subprocess.run(
        [str(KVOFFLOAD), "plan", "--model", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_user_env(),
    )
    assert proc.returncode in (0, 1), proc.stderr  # 1: the deployment is not valid (the JSON says why)
    assert json.loads(proc.stdout)["valid"] is (proc.returncode == 0)


def test_bench_pool_json_prints_one_json_document_and_its_logs_on_stderr():
    """The pool bench starts a metastore, a mooncake_master and Memcache's MetaService, and the
    memcache library logs from native code on file descriptor 1: all of it must reach stderr. Its
    document: every backend has its entry, the measured ones read back what they were given in this
    process and in another one, and the figures are ratios to the memcpys timed next to each run, the
    reader's in the reader (merged from ``test_bench_pool.py``, which ran this bench a second time to
    check them; the ratios under a changing load: ``libs/kvoffload_bench/tests/test_pool_memcpy.py``)."""
    proc = _driven("""
        import functools, sys
        import kvoffload_bench.pool as bench
        bench.run = functools.partial(bench.run, repeats=2, shapes=("kv_block",))  # small sizes, no goal judged
        from kvoffload.cli import main
        sys.exit(main(["bench", "pool", "--json"]))
    """)
    assert proc.returncode == 3, proc.stderr[-3000:]  # its goals are the 1mib shape's: not measured
    r = json.loads(proc.stdout)
    assert r["bench"] == "pool" and set(r["backends"]) == {"kvoffload", "mooncake", "memcache"}
    assert r["goals_met"] == {"kvoffload_1mib_put_ratio": False, "kvoffload_1mib_get_ratio": False}
    assert "kvoffload_1mib_put_ratio (not measured: the 1mib shape was not run)" in proc.stderr
    rows, row_bytes, count = SHAPES["kv_block"]
    assert r["shapes"]["kv_block"] == {
        "rows": rows,
        "row_bytes": row_bytes,
        "object_bytes": rows * row_bytes,
        "objects": count,
    }
    assert "memcpy_gbps" not in r  # no memcpy timed once for all: each run's is timed next to it
    for name in ("kvoffload", "mooncake"):  # make test installs Mooncake: both must have run
        b = r["backends"][name]
        assert b["available"] is True, b
        fig = b["kv_block"]
        for op in ("put", "get", "get_cross_process"):  # the last one's runs and memcpys in the reader
            runs = fig[f"{op}_runs_s"]
            assert len(runs) == 2 and all(s > 0 and m > 0 for s, m in runs), (op, runs)
            assert fig[f"{op}_gbps"] > 0 and fig[f"{op}_memcpy_gbps"] > 0
            assert fig[f"{op}_ratio"] == pytest.approx(statistics.median(m / s for s, m in runs))
    memcache = r["backends"]["memcache"]  # no Ascend NPU here: memcache_hybrid's own reason, the driver
    assert memcache["available"] is False and "ascend driver" in memcache["reason"].lower(), memcache


def test_whatever_a_bench_writes_to_stdout_goes_to_stderr():
    """Python prints, writes to descriptor 1, C stdio (buffered when stdout is a pipe), child processes
    and structlog: stdout keeps the JSON alone."""
    proc = _driven(
        """
        import ctypes, os, subprocess, sys
        import structlog
        from kvoffload import cli, cli_bench

        def noisy():
            print("a print")
            os.write(1, b"a write to descriptor 1\\n")
            ctypes.CDLL(None).printf(b"a C printf\\n")
            subprocess.run(["echo", "a child process"], check=True)
            structlog.get_logger().warning("a structlog warning")
            return {"bench": "noisy", "goals_met": {"quiet": True}}

        cli_bench._load = lambda target: noisy
        sys.exit(cli.main(["bench", "prefix", "--json"]))
    """,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"bench": "noisy", "goals_met": {"quiet": True}}
    for line in ("a print", "a write to descriptor 1", "a C printf", "a child process", "a structlog warning"):
        assert line in proc.stderr
