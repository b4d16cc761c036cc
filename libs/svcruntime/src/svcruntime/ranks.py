"""The rank processes of one service (tensor parallelism): start, join, watch, stop.

A service with ``--tensor-parallel-size N`` is rank 0 of a ``torch.distributed`` gloo group and
starts ranks 1..N-1 itself, one process each, on this host. ``RankProcesses.start`` spawns them
(``argv(rank, init)`` is each one's command line; ``init`` the group's file rendezvous, in a
private directory) and joins the group as rank 0 while it watches them: a rank that exits before
it joined ends the start-up at once with a ``StartupError`` naming the rank and its exit code,
instead of waiting out the join timeout. Once running, ``watch(on_exit)`` calls ``on_exit(rank,
pid, code)`` (from a watcher thread, once) for the first rank that exits, so the service can stop
taking requests and say why. ``stop`` waits for the ranks to end (killing any that does not in
time), destroys the group when it is whole and removes the rendezvous directory.

``LeadRanks`` is rank 0's side of such a group, whatever the ranks compute: a service's
``TPRanks`` says what broke the group (``broken`` / ``mark_broken``) and how rank 0 tells the
followers to return (``followers_closer``); the watch (a rank that exits breaks the group),
``not_ready`` and the orderly ``close`` are the same for every service. A follower rank joins the
group with ``join_group`` (its flags: ``follower_parser``) and takes its share of the host's cores
with ``share_cores``.

What the ranks compute and how rank 0 leads them is the service's business (its model library).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from datetime import timedelta

import structlog

from svcruntime.serving import StartupError

log = structlog.get_logger(__name__)

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "JOIN_TIMEOUT_S",
    "LeadRanks",
    "RankProcesses",
    "follower_parser",
    "join_group",
    "share_cores",
]

JOIN_TIMEOUT_S = 300.0  # every rank loaded its model and joined the group within this
COLLECTIVE_TIMEOUT_S = 600.0  # a follower waits this long for rank 0's next message or reduction


class RankProcesses:
    """Ranks 1..N-1 of one service, started and joined by ``start``; rank 0 is this process."""

    def __init__(self, size: int, procs: list[subprocess.Popen], workdir: str, flag: str) -> None:
        self.size, self.procs, self._workdir, self._flag = size, procs, workdir, flag
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @classmethod
    def start(
        cls,
        size: int,
        argv: Callable[[int, str], list[str]],
        *,
        join_timeout_s: float = JOIN_TIMEOUT_S,
        flag: str = "--tensor-parallel-size",
    ) -> RankProcesses:
        """Spawn ranks 1..size-1 (``argv(rank, init)``) and join their gloo group as rank 0; the
        group's collectives then time out after ``join_timeout_s`` too. StartupError (everything
        started is stopped) when a rank exits first or the join fails."""
        workdir = tempfile.mkdtemp(prefix="kvoffload-ranks-")
        init = f"file://{workdir}/rendezvous"
        procs: list[subprocess.Popen] = []
        try:
            procs.extend(subprocess.Popen(argv(r, init)) for r in range(1, size))
            _join(procs, init, size, join_timeout_s, flag)
        except BaseException:
            for p in procs:
                p.kill()
                p.wait()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return cls(size, procs, workdir, flag)

    def watch(self, on_exit: Callable[[int, int, int], None], every_s: float = 0.5) -> None:
        """From now on, the first rank to exit is reported once: ``on_exit(rank, pid, exit_code)``."""

        def run() -> None:
            while not self._closing.wait(every_s):
                for rank, p in enumerate(self.procs, start=1):
                    code = p.poll()
                    if code is not None:
                        log.error("tp_rank_exited", rank=rank, pid=p.pid, exit_code=code)
                        on_exit(rank, p.pid, code)
                        return

        self._watcher = threading.Thread(target=run, name="tp-ranks", daemon=True)
        self._watcher.start()

    def stop(self, *, group_whole: bool, timeout_s: float = 10.0) -> list[int | None]:
        """Wait for the ranks to end (the caller told them to), killing any still running after
        ``timeout_s``; destroy the process group when ``group_whole`` (a broken one may abort in
        its destructors). Returns the exit codes."""
        import torch.distributed as dist

        self._closing.set()
        for p in self.procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if group_whole:
            dist.destroy_process_group()
        shutil.rmtree(self._workdir, ignore_errors=True)
        return [p.returncode for p in self.procs]


class LeadRanks(ABC):
    """Rank 0's side of a service's TP group: the processes of ranks 1..N-1 and what rank 0 leads
    them with (module doc)."""

    def __init__(self, processes: RankProcesses) -> None:
        self.size, self.processes = processes.size, processes

    @abstractmethod
    def broken(self) -> str:
        """Why the group is out of step ("" while every rank is in step)."""

    @abstractmethod
    def mark_broken(self, why: str) -> None:
        """The group is out of step for ``why`` (the first reason stands)."""

    @abstractmethod
    def followers_closer(self) -> Callable[[], None] | None:
        """What tells the followers to return, or None when rank 0 cannot tell them (the group is
        broken, or rank 0 never led it): then they are only waited for, and killed."""

    def watch(self) -> None:
        """From now on, a rank that exits breaks the group, naming the rank and its exit code."""
        self.processes.watch(
            lambda rank, pid, code: self.mark_broken(f"TP rank {rank} (pid {pid}) exited with code {code}")
        )

    def not_ready(self) -> str:
        """Why the group cannot serve ("" while every rank is in step)."""
        broken = self.broken()
        return f"tensor parallel group: {broken}" if broken else ""

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the followers to return, wait for them (killing any that does not end in time)."""
        closer = self.followers_closer()
        whole = closer is not None
        if closer is not None:
            try:
                closer()
            except Exception as exc:  # noqa: BLE001 - a follower gone at the last moment: they are killed below
                log.warning("tp_close_failed", error=repr(exc))
                whole = False
        codes = self.processes.stop(group_whole=whole, timeout_s=timeout_s)
        log.info("tp_ranks_closed", size=self.size, exit_codes=codes)


def follower_parser(prog: str) -> argparse.ArgumentParser:
    """The flags every follower rank takes (its service adds its own): ``--rank R --size N --init I``,
    ``I`` being the group's rendezvous that ``RankProcesses.start`` passes to ``argv``."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init", required=True)
    return p


def share_cores(size: int) -> None:
    """This rank's torch threads: its share of the host's cores (the ``size`` ranks share them)."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def join_group(init: str, rank: int, size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
    """A follower joins rank 0's gloo group at ``init``; its collectives time out after ``timeout_s``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))


def _join(procs: list[subprocess.Popen], init: str, size: int, timeout_s: float, flag: str) -> None:
    """Join the group as rank 0, watching the other ranks meanwhile: one that exits before it joined
    (its model did not load, say) ends the wait at once, naming its rank and exit code."""
    import torch.distributed as dist

    failed: list[BaseException] = []

    def init_group() -> None:
        try:
            dist.init_process_group(
                "gloo", init_method=init, rank=0, world_size=size, timeout=timedelta(seconds=timeout_s)
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            failed.append(exc)

    joiner = threading.Thread(target=init_group, name="tp-join", daemon=True)
    joiner.start()
    while joiner.is_alive():
        joiner.join(0.2)
        for rank, p in enumerate(procs, start=1):
            code = p.poll()
            if code is not None and joiner.is_alive():
                raise StartupError(
                    f"{flag} {size}: TP rank {rank} exited with code {code} "
                    "before it joined the group (its log lines above say why)"
                )
    if failed:
        raise StartupError(f"{flag} {size}: joining the TP group failed: {failed[0]!r}")
