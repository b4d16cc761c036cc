"""The thread plan of reference services that share one host's cores (``kvoffload_testing.stack``): idle
OpenMP threads sleep, a decode takes a quarter of the cores, the user's own settings win, and the
spawned services really get it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from kvoffload_testing.stack import Stack, StackConfig
from kvoffload_testing.stack_threads import colocated_threads_env


@pytest.mark.parametrize(("cores", "decode_threads"), [(1, "1"), (2, "1"), (4, "1"), (8, "2"), (64, "16")])
def test_a_decode_gets_a_quarter_of_the_cores_and_a_prefill_all(cores, decode_threads):
    assert colocated_threads_env("decode-0", cores, {}) == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "OMP_NUM_THREADS": decode_threads,
    }
    assert colocated_threads_env("prefill-1", cores, {}) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_other_services_and_the_users_own_settings_are_left_alone():
    for name in ("metastore", "proxy", "mooncake-master"):
        assert colocated_threads_env(name, 8, {}) == {}
    assert colocated_threads_env("decode-0", 8, {"OMP_NUM_THREADS": "6"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert colocated_threads_env("prefill-0", 8, {"OMP_WAIT_POLICY": "ACTIVE"}) == {}


def test_a_spawned_decode_runs_with_the_plan(tmp_path, monkeypatch):
    """The environment a Stack gives its child (read back from /proc), not only the mapping."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    stack = Stack(StackConfig(model=tmp_path, log_dir=tmp_path))
    service = stack._service("decode-0", [sys.executable, "-c", "import time; time.sleep(30)"], "")
    service.spawn()
    proc = service.proc
    try:
        deadline = time.monotonic() + 10
        while b"time.sleep" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():  # the launcher execs it
            assert time.monotonic() < deadline, "the service was never exec'd"
            time.sleep(0.05)
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{proc.pid}/environ").read_text().split("\0") if "=" in kv)
    finally:
        proc.kill()
        proc.wait()
    cores = len(os.sched_getaffinity(0))
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["OMP_NUM_THREADS"] == str(max(1, cores // 4)), env
