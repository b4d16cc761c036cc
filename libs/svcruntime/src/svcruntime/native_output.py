"""What a native library prints while Python calls it: ``native_output`` captures file descriptors
1 and 2 around a block, so that a library which reports its errors only by printing them (memfabric,
memcache, Mooncake) can be quoted in the exception the caller raises (``error_lines`` picks its error
lines out). One capture runs at a time in a process (the descriptors are the process's); the bytes go
back to the descriptor they were written to afterwards — delayed, never lost."""

from __future__ import annotations

import ctypes
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["error_lines", "native_output"]

_capture_lock = threading.Lock()


@contextmanager
def native_output() -> Iterator[list[str]]:
    """Capture what native code writes to fds 1 and 2 in the block; the list gets the lines after the
    block, and the bytes go back to the fd they were written to."""
    lines: list[str] = []
    with _capture_lock, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = {1: os.dup(1), 2: os.dup(2)}
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            yield lines
        finally:
            ctypes.CDLL(None).fflush(None)  # the library's C stdio buffers
            for fd, tmp in ((1, out), (2, err)):
                os.dup2(saved[fd], fd)
                os.close(saved[fd])
                tmp.seek(0)
                data = tmp.read()
                if data:
                    os.write(fd, data)
                lines.extend(data.decode(errors="replace").splitlines())


def error_lines(lines: Sequence[str], pattern: re.Pattern[str]) -> str:
    """The lines ``pattern`` matches (its named groups ``src``: where in the library, ``msg``: what
    it said), the first of each ``src``, as ``msg (src)`` joined by "; "; "" when none matches."""
    seen: set[str] = set()
    out = []
    for line in lines:
        m = pattern.search(line.strip())
        if m is None or m["src"] in seen:
            continue
        seen.add(m["src"])
        out.append(f"{m['msg'].strip()} ({m['src']})")
    return "; ".join(out)
