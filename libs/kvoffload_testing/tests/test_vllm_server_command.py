"""What ``VllmServer`` runs (no server started): a one-rank server's worker inside the engine core's
process (``uni`` executor, VLLM_ENABLE_V1_MULTIPROCESSING=0), its CPUs bound as vLLM's ``mp``
executor would bind them; a server of several ranks as vLLM starts it."""

import os
import sys

import pytest

from kvoffload_testing.vllm_server import VllmServer, cpu_ids, in_process_binding, ranks_of


@pytest.mark.parametrize(
    ("args", "ranks"),
    [
        ([], 1),
        (["--tensor-parallel-size", "2"], 2),
        (["--tensor-parallel-size=4"], 4),
        (["-tp", "2", "--pipeline-parallel-size", "2"], 4),
        (["--kv-transfer-config", "{}", "-pp=1"], 1),
    ],
)
def test_the_ranks_of_a_command_line(args, ranks):
    assert ranks_of(args) == ranks


def test_cpu_lists_as_vllm_writes_them():
    assert cpu_ids("0") == [0] and cpu_ids("2,3") == [2, 3] and cpu_ids("0-3,6") == [0, 1, 2, 3, 6]


def test_a_bound_server_runs_on_its_cpus_with_one_thread_each():
    env = {"VLLM_CPU_OMP_THREADS_BIND": "1-2"}
    argv = in_process_binding(["vllm", "--x"], env)
    assert env["OMP_NUM_THREADS"] == "2"
    assert argv[:2] == [sys.executable, "-c"] and argv[3:] == ["1,2", "vllm", "--x"]
    assert "sched_setaffinity" in argv[2]


def test_auto_keeps_one_cpu_for_the_rest_and_nobind_binds_nothing():
    env: dict[str, str] = {}
    assert in_process_binding(["vllm"], env) == ["vllm"]
    assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) - 1))
    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert in_process_binding(["vllm"], env) == ["vllm"] and "OMP_NUM_THREADS" not in env


def test_one_rank_runs_its_worker_in_the_engine_core_and_several_keep_worker_processes(tmp_path):
    one = VllmServer(tmp_path / "m", port=1234, log_path=tmp_path / "a.log", env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert (
        "--distributed-executor-backend" in one.cmd
        and one.cmd[one.cmd.index("--distributed-executor-backend") + 1] == "uni"
    )
    assert one.env()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and one.env()["OMP_NUM_THREADS"] == "1"
    assert one.cmd[3] == "0" and "vllm.entrypoints.openai.api_server" in one.cmd
    two = VllmServer(tmp_path / "m", port=1235, log_path=tmp_path / "b.log", extra_args=["--tensor-parallel-size", "2"])
    assert "--distributed-executor-backend" not in two.cmd
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in two.env() or two.env()["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0"
    assert two.cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
