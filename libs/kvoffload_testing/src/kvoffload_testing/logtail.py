"""The last lines of a service's log file, for the error that names the service."""

from __future__ import annotations

from collections import deque
from pathlib import Path


def tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` lines of the text file ``path`` (empty when it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except FileNotFoundError:
        return ""
