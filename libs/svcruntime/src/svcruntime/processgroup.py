"""A child's whole process group (a server with workers, e.g. a vLLM API server, its engine core and
workers): its live members, a signal to all of them, and a stop (SIGTERM, then SIGKILL) that waits
until none is left. Linux (``/proc``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes in process group ``pgid``, from ``/proc``."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses, so split after the last ')'
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def signal_group(proc: subprocess.Popen, sig: signal.Signals, timeout_s: float) -> bool:
    """Send ``sig`` to the process group ``proc`` leads; True once ``proc`` is reaped and no member of
    the group is alive (within ``timeout_s``)."""
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.poll()  # reaps the leader, so it does not linger as a zombie
        if proc.returncode is not None and not group_members(pgid):
            return True
        time.sleep(0.1)
    return False


def stop_group(proc: subprocess.Popen, timeout_s: float, what: str = "the") -> None:
    """Stop every process of the group ``proc`` leads (``start_new_session``): SIGTERM, wait up to
    ``timeout_s``, then SIGKILL; :class:`RuntimeError` when a member survives even that."""
    if not signal_group(proc, signal.SIGTERM, timeout_s):
        signal_group(proc, signal.SIGKILL, 10.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)
    if group_members(proc.pid):
        raise RuntimeError(f"processes {group_members(proc.pid)} of {what} group {proc.pid} survived SIGKILL")
