"""RankProcesses: rank processes of one service, started, joined, watched and stopped. Each scenario
runs in a fresh interpreter (rank 0 of a gloo group is process-wide state). LeadRanks: rank 0's
readiness and orderly close over them (its processes stood in for)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

RANK = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    init, rank, code = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if code == 3:
        sys.exit(3)  # dies before it joins
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    dist.barrier()
    dist.barrier()
    sys.exit(code)
""")

LEADER = textwrap.dedent("""
    import json, sys, threading
    import torch.distributed as dist
    from svcruntime.ranks import RankProcesses
    from svcruntime.serving import StartupError
    rank_src, code = sys.argv[1], int(sys.argv[2])
    argv = lambda r, init: [sys.executable, "-c", rank_src, init, str(r), str(code)]
    try:
        procs = RankProcesses.start(2, argv, join_timeout_s=60)
    except StartupError as exc:
        print(json.dumps({"startup_error": str(exc)}))
        sys.exit(0)
    exited, seen = threading.Event(), []
    procs.watch(lambda rank, pid, c: (seen.append([rank, pid == procs.pids[0], c]), exited.set()), every_s=0.05)
    dist.barrier()
    dist.barrier()
    exited.wait(30)
    print(json.dumps({"seen": seen, "codes": procs.stop(group_whole=True)}))
""")


def _lead(code: int) -> dict:
    out = subprocess.run([sys.executable, "-c", LEADER, RANK, str(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_rank_that_exits_is_reported_once_with_its_code_and_stop_collects_it():
    assert _lead(7) == {"seen": [[1, True, 7]], "codes": [7]}


def test_a_rank_that_exits_before_joining_ends_the_start_at_once_naming_it():
    got = _lead(3)
    assert got["startup_error"].startswith("--tensor-parallel-size 2: TP rank 1 exited with code 3 before it joined")


class _Processes:
    """RankProcesses' side, as LeadRanks uses it: the watch and the stop."""

    size = 3

    def __init__(self) -> None:
        self.on_exit, self.stopped = None, []

    def watch(self, on_exit) -> None:
        self.on_exit = on_exit

    def stop(self, *, group_whole: bool, timeout_s: float) -> list[int]:
        self.stopped.append(group_whole)
        return [0, 0]


def _ranks(processes: _Processes, close_fails: bool = False):
    from svcruntime.ranks import LeadRanks

    class Ranks(LeadRanks):
        why, closed = "", 0

        def broken(self) -> str:
            return self.why

        def mark_broken(self, why: str) -> None:
            self.why = self.why or why

        def followers_closer(self):
            return None if self.why else self.close_followers

        def close_followers(self) -> None:
            self.closed += 1
            if close_fails:
                raise RuntimeError("a follower is gone")

    return Ranks(processes)


def test_a_rank_that_exits_makes_the_group_not_ready_and_it_is_only_stopped():
    procs = _Processes()
    ranks = _ranks(procs)
    ranks.watch()
    assert ranks.not_ready() == ""
    procs.on_exit(2, 4242, 9)
    procs.on_exit(1, 4241, 1)  # the first reason stands
    assert ranks.not_ready() == "tensor parallel group: TP rank 2 (pid 4242) exited with code 9"
    ranks.close()
    assert (ranks.closed, procs.stopped) == (0, [False])


def test_a_whole_group_tells_its_followers_to_return_and_a_failed_telling_breaks_it():
    procs = _Processes()
    ranks = _ranks(procs)
    ranks.close()
    assert (ranks.closed, procs.stopped) == (1, [True])
    procs = _Processes()
    ranks = _ranks(procs, close_fails=True)
    ranks.close()
    assert (ranks.closed, procs.stopped) == (1, [False])
