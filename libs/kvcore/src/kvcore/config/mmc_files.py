"""The seed's Memcache conf files (``mmc-meta.conf`` / ``mmc-local.conf``): ``key = value`` lines,
the size format, the rules the two files keep together, and the keys a pool owner reads from them.

A conf file is ``key = value`` lines; ``#`` starts a comment; a key may appear once. Sizes are
``<int><unit>`` with binary units: ``10GB`` = 10 * 2**30 bytes (B, K/KB/KiB, M/MB/MiB, G/GB/GiB,
T/TB/TiB). The metastore reads every key it knows (``kvoffload_metastore.config``); a prefill or
LocalService pool reads ``ock.mmc.local_service.dram.size`` to size itself (``MmcPair.dram_size``).

The pair (``mmc_pair``), as the guide states it: both files name the same MetaService
(``ock.mmc.meta_service_url``), the LocalService's config store
(``ock.mmc.local_service.config_store_url``) is the MetaService's
(``ock.mmc.meta_service.config_store_url``), and ``ock.mmc.local_service.protocol`` is one of
``PROTOCOLS``; each broken rule is a ``ValueError`` naming both values and where each was read.
A file is its path argument, else ``$MMC_META_CONFIG_PATH`` / ``$MMC_LOCAL_CONFIG_PATH``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

META_ENV = "MMC_META_CONFIG_PATH"
LOCAL_ENV = "MMC_LOCAL_CONFIG_PATH"
DRAM_KEY = "ock.mmc.local_service.dram.size"
META_URL_KEY = "ock.mmc.meta_service_url"
META_STORE_KEY = "ock.mmc.meta_service.config_store_url"
LOCAL_STORE_KEY = "ock.mmc.local_service.config_store_url"
PROTOCOL_KEY = "ock.mmc.local_service.protocol"
# the LocalService's transports (memcache_hybrid 1.3): host_* move bytes through host memory or NICs,
# device_* through the accelerator (device_sdma on A3/HCCS, device_rdma on A2/RoCE)
PROTOCOLS = (
    "host_rdma",
    "host_urma",
    "host_tcp",
    "host_shm",
    "device_rdma",
    "device_urma",
    "device_uboe",
    "device_sdma",
)

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


def parse_url(text: str, key: str, schemes: tuple[str, ...] = ("tcp",)) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (or another of ``schemes``) -> (host, port), IPv6 hosts in brackets;
    ValueError naming ``key``."""
    m = re.match(r"^([a-z]+)://(\[[0-9A-Fa-f:.]+\]|[^:/\s\[\]]+):(\d{1,5})/?$", text.strip())
    if not m or m.group(1) not in schemes or not 1 <= int(m.group(3)) <= 65535:
        raise ValueError(f"{key}: expected {schemes[0]}://HOST:PORT with a port in 1..65535, got {text!r}")
    return m.group(2).strip("[]"), int(m.group(3))


@dataclass(frozen=True)
class MmcPair:
    """What the two conf files say together, checked against each other (module docstring)."""

    meta_path: str | None
    local_path: str | None
    meta_service: tuple[str, int] | None  # (host, port) of ock.mmc.meta_service_url, from either file
    meta_service_where: str  # "KEY (file:line)" it was read at; "" when neither file names it
    protocol: str | None  # ock.mmc.local_service.protocol of the mmc-local.conf
    dram: tuple[str, str] | None  # (value, "file:line") of the mmc-local.conf's dram.size, unparsed

    def dram_size(self) -> tuple[int, str] | None:
        """``(bytes, "DRAM_KEY (file:line)")`` of the mmc-local.conf's ``dram.size``; None when the
        file is not named or lacks the key. ValueError names the file, line and key of a malformed or
        non-positive value."""
        if self.dram is None:
            return None
        value, where = self.dram
        named = f"{DRAM_KEY} ({where})"
        size = parse_size_bytes(value, named)
        if size <= 0:
            raise ValueError(f"{named}: expected a size > 0, got {value!r}")
        return size, named

    @property
    def metastore(self) -> str | None:
        """The MetaService as ``HOST:PORT`` (a kvoffload-metastore address), None when unnamed."""
        if self.meta_service is None:
            return None
        host, port = self.meta_service
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def mmc_pair(
    meta_config: str | None = None, local_config: str | None = None, env: Mapping[str, str] | None = None
) -> MmcPair:
    """The two files (paths, else the ``MMC_*`` variables of ``env``) read and checked as a pair;
    ValueError names the broken rule, both values and where each was read."""
    env = os.environ if env is None else env
    meta_path, local_path = meta_config or env.get(META_ENV), local_config or env.get(LOCAL_ENV)
    meta = read_conf(meta_path) if meta_path else {}
    local = read_conf(local_path) if local_path else {}
    meta_url, local_url = _url(meta, META_URL_KEY), _url(local, META_URL_KEY)
    _same(meta_url, local_url, "both files must name the same MetaService")
    _same(
        _url(meta, META_STORE_KEY),
        _url(local, LOCAL_STORE_KEY),
        "the LocalService's config store must be the MetaService's",
    )
    protocol = local.get(PROTOCOL_KEY)
    if protocol is not None and protocol[0] not in PROTOCOLS:
        raise ValueError(f"{PROTOCOL_KEY} ({protocol[1]}): expected one of {', '.join(PROTOCOLS)}, got {protocol[0]!r}")
    service = meta_url or local_url
    return MmcPair(
        meta_path,
        local_path,
        service[0] if service else None,
        service[1] if service else "",
        protocol[0] if protocol else None,
        local.get(DRAM_KEY),
    )


_Url = tuple[tuple[str, int], str]  # ((host, port), "KEY = value (file:line)")


def _url(conf: dict[str, tuple[str, str]], key: str) -> _Url | None:
    if key not in conf:
        return None
    value, where = conf[key]
    return parse_url(value, f"{key} ({where})"), f"{key} = {value} ({where})"


def _same(first: _Url | None, second: _Url | None, rule: str) -> None:
    """Both named and at different endpoints: ValueError naming both and the rule."""
    if first is not None and second is not None and first[0] != second[0]:
        raise ValueError(f"{second[1]} differs from {first[1]}: {rule}")
