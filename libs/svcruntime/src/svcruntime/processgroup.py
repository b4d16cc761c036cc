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


def still_ours(proc: subprocess.Popen) -> bool:
    """Whether the process group number ``proc.pid`` can still name the group ``proc`` leads. Until
    the leader is reaped the number is held; once it is, Linux gives the number to a new process
    only when no member of the group is left (a pid stays allocated while any process has it as its
    group), so a live process of that number means the group is gone and the number is a
    stranger's: a test's new session leader, whose whole group a signal would hit."""
    return proc.poll() is None or not os.path.exists(f"/proc/{proc.pid}")


def signal_group(proc: subprocess.Popen, sig: signal.Signals, timeout_s: float) -> bool:
    """Send ``sig`` to the process group ``proc`` leads; True once ``proc`` is reaped and no member of
    the group is alive (within ``timeout_s``). A group already gone is not signalled (``still_ours``)."""
    pgid = proc.pid
    if not still_ours(proc):
        return True
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proc.poll()  # reaps the leader, so it does not linger as a zombie
        if proc.returncode is not None and not (still_ours(proc) and group_members(pgid)):
            return True
        time.sleep(0.1)
    return False


def stop_group(proc: subprocess.Popen, timeout_s: float, what: str = "the") -> None:
    """Stop every process of the group ``proc`` leads (``start_new_session``): SIGTERM, wait up to
    ``timeout_s``, then SIGKILL; :class:`RuntimeError` when a member survives even that. Stopping a
    group already gone does nothing (a second stop; a server that exited at start-up)."""
    if not signal_group(proc, signal.SIGTERM, timeout_s):
        signal_group(proc, signal.SIGKILL, 10.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)
    if still_ours(proc) and group_members(proc.pid):
        raise RuntimeError(f"processes {group_members(proc.pid)} of {what} group {proc.pid} survived SIGKILL")
