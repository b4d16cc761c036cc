"""processgroup: a group is signalled while it is ours, never once its number may be a stranger's."""

from __future__ import annotations

import signal
import subprocess
import sys

from svcruntime.processgroup import group_members, signal_group, still_ours, stop_group

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_group_with_a_worker_is_stopped_whole():
    leader = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, time; subprocess.Popen({SLEEP!r}); time.sleep(60)"],
        start_new_session=True,
    )
    try:
        while len(group_members(leader.pid)) < 2:
            assert leader.poll() is None
        stop_group(leader, 5.0)
        assert leader.returncode == -signal.SIGTERM and group_members(leader.pid) == []
    finally:
        signal_group(leader, signal.SIGKILL, 5.0)


def test_a_reaped_leaders_number_held_by_a_stranger_is_left_alone():
    """The number of a reaped leader, given by Linux to another session's leader (here: the stranger's
    pid put in the old Popen's place, as reuse would), is not ours: neither a stop nor a signal of the
    old group may reach the stranger."""
    gone = subprocess.Popen([sys.executable, "-c", ""], start_new_session=True)
    gone.wait()
    stranger = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        gone.pid = stranger.pid
        assert not still_ours(gone)
        stop_group(gone, 1.0)
        assert signal_group(gone, signal.SIGKILL, 1.0)
        assert stranger.poll() is None, "a stop of a group already gone signalled a stranger"
    finally:
        stranger.kill()
        stranger.wait()
