"""The seed's Memcache conf files (``mmc-meta.conf`` / ``mmc-local.conf``): ``key = value`` lines,
the size format, and the one key a pool owner reads from them (``dram.size``).

A conf file is ``key = value`` lines; ``#`` starts a comment; a key may appear once. Sizes are
``<int><unit>`` with binary units: ``10GB`` = 10 * 2**30 bytes (B, K/KB/KiB, M/MB/MiB, G/GB/GiB,
T/TB/TiB). The metastore reads every key it knows (``kvoffload_metastore.config``); a prefill or
LocalService pool reads ``ock.mmc.local_service.dram.size`` to size itself (``local_dram_size``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

META_ENV = "MMC_META_CONFIG_PATH"
LOCAL_ENV = "MMC_LOCAL_CONFIG_PATH"
DRAM_KEY = "ock.mmc.local_service.dram.size"

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size_bytes(text: str, key: str = DRAM_KEY) -> int:
    """``"10GB"`` -> 10 * 2**30 (module docstring); ValueError naming ``key`` otherwise."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"{key}: expected a size like 10GB or 512MB, got {text!r}")
    unit = (m.group(2) or "").upper().replace("I", "").rstrip("B") or ("B" if m.group(2) else "")
    return int(m.group(1)) * _UNITS[unit]


def read_conf(path: str | os.PathLike[str]) -> dict[str, tuple[str, str]]:
    """``key -> (value, "file:line")`` of one conf file; ValueError on a malformed or repeated line."""
    out: dict[str, tuple[str, str]] = {}
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read conf file {path}: {e.strerror or e}") from None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{n}"
        key, eq, value = (s.strip() for s in line.partition("="))
        if not eq or not key:
            raise ValueError(f"{where}: expected 'key = value', got {raw.strip()!r}")
        if key in out:
            raise ValueError(f"{where}: {key} is repeated (first at {out[key][1]})")
        out[key] = (value, where)
    return out


def local_dram_size(local_config: str | None = None, env: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """``(bytes, "DRAM_KEY (file:line)")`` of ``dram.size`` in the mmc-local.conf at ``local_config``
    (else ``$MMC_LOCAL_CONFIG_PATH``); None when there is no such file named or it lacks the key.
    ValueError names the file, line and key of a malformed or non-positive value."""
    env = os.environ if env is None else env
    path = local_config or env.get(LOCAL_ENV)
    if not path:
        return None
    entry = read_conf(path).get(DRAM_KEY)
    if entry is None:
        return None
    value, where = entry
    named = f"{DRAM_KEY} ({where})"
    size = parse_size_bytes(value, named)
    if size <= 0:
        raise ValueError(f"{named}: expected a size > 0, got {value!r}")
    return size, named
