"""``MetaStoreConfig``: the metastore's one validated config, built once from the seed's conf files
(``mmc-meta.conf`` / ``mmc-local.conf``) and the command-line flags.

Precedence: defaults < conf files (``--meta-config`` / ``MMC_META_CONFIG_PATH``, then
``--local-config`` / ``MMC_LOCAL_CONFIG_PATH``) < flags. A conf file is ``key = value`` lines;
``#`` starts a comment. Keys:

======================================  ==================================================
``ock.mmc.meta_service_url``            ``tcp://HOST:PORT``: the bind address
``ock.mmc.meta.lease_ttl_ms``           default read-lease TTL (ms, > 0; default 30000)
``ock.mmc.local_service.world_size``    most LocalService pools registered at once (>= 1)
``ock.mmc.local_service.dram.size``     host memory per LocalService, e.g. ``10GB``
                                        (binary units: 1 GB = 2**30 bytes); reported in Stats
``ock.mmc.log_level``                   debug | info | warning | error | critical
======================================  ==================================================

``IGNORED`` keys are accepted and logged with the reason; any other key is logged as unknown.
A malformed line or value is a ``ValueError`` naming the file, line and key; so are the two
files' disagreements (``kvcore.config.mmc_files.mmc_pair``: another MetaService, another config store, an
unknown protocol).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvcore.config.mmc_files import DRAM_KEY, mmc_pair, parse_size_bytes, parse_url, read_conf
from svcruntime.tls import TLSConfig

URL_KEY = "ock.mmc.meta_service_url"
TTL_KEY = "ock.mmc.meta.lease_ttl_ms"
WORLD_KEY = "ock.mmc.local_service.world_size"
LOG_KEY = "ock.mmc.log_level"

NO_CONFIG_STORE = "the embedded MetaStore keeps pool registrations itself; there is no separate config store"
IGNORED = {
    "ock.mmc.meta_service.config_store_url": NO_CONFIG_STORE,
    "ock.mmc.local_service.config_store_url": NO_CONFIG_STORE,
    "ock.mmc.local_service.protocol": "embedded pools move bytes through host shared memory, not device SDMA/RDMA",
}

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)


class MetaStoreConfig(BaseModel):
    """The metastore's settings; field names are the flags' (``--lease-ttl-ms`` -> ``lease_ttl_ms``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # --grace-s inf would hang

    host: str = Field("127.0.0.1", min_length=1)
    port: int = Field(5000, ge=0, le=65535)  # 0: any free port (tests)
    lease_ttl_ms: int = Field(30_000, ge=1, le=86_400_000)
    world_size: int = Field(256, ge=1)
    dram_bytes_per_local_service: int = Field(0, ge=0)  # 0: not configured
    heartbeat_timeout_ms: int = Field(10_000, ge=1)
    log_level: LogLevel = "info"
    metrics_port: int = Field(0, ge=0, le=65535)  # 0: no /metrics
    grace_s: float = Field(5.0, ge=0)
    max_workers: int = Field(8, ge=1)
    sources: tuple[str, ...] = ()  # conf files read, for Stats info
    tls: TLSConfig | None = None  # --tls-cert/--tls-key/--tls-ca (svcruntime.tls); None: plain gRPC

    @property
    def bind_address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _positive_int(text: str, key: str) -> int:
    if not re.fullmatch(r"\d+", text) or int(text) < 1:
        raise ValueError(f"{key}: expected an integer >= 1, got {text!r}")
    return int(text)


def _log_level(text: str, key: str) -> str:
    level = {"warn": "warning", "fatal": "critical"}.get(text.lower(), text.lower())
    if level not in LOG_LEVELS:
        raise ValueError(f"{key}: expected one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


def conf_settings(entries: Mapping[str, tuple[str, str]]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Config fields from conf entries, plus ``(level, note)`` for ignored and unknown keys (for the log)."""
    fields: dict[str, Any] = {}
    notes: list[tuple[str, str]] = []
    for key, (value, where) in entries.items():
        named = f"{key} ({where})"
        if key == URL_KEY:
            fields["host"], fields["port"] = parse_url(value, named)
        elif key == TTL_KEY:
            fields["lease_ttl_ms"] = _positive_int(value, named)
        elif key == WORLD_KEY:
            fields["world_size"] = _positive_int(value, named)
        elif key == DRAM_KEY:
            fields["dram_bytes_per_local_service"] = parse_size_bytes(value, named)
            if not fields["dram_bytes_per_local_service"]:
                raise ValueError(f"{named}: expected a size > 0, got {value!r}")
        elif key == LOG_KEY:
            fields["log_level"] = _log_level(value, named)
        elif key in IGNORED:
            notes.append(("info", f"{named} ignored by the embedded backend: {IGNORED[key]}"))
        else:
            notes.append(("warning", f"{named} is an unknown key; ignored"))
    return fields, notes


def build_config(
    *,
    meta_config: str | None = None,
    local_config: str | None = None,
    env: Mapping[str, str] | None = None,
    **flags: Any,
) -> tuple[MetaStoreConfig, list[tuple[str, str]]]:
    """The config from conf files (paths, else the MMC_* variables of ``env``) and flags (None = not given).

    Returns the config and ``(level, note)`` pairs to log (ignored / unknown keys). ValueError
    names the bad key or flag.
    """
    env = os.environ if env is None else env
    pair = mmc_pair(meta_config, local_config, env)  # the same MetaService and config store, a known protocol
    paths = [p for p in (pair.meta_path, pair.local_path) if p]
    entries: dict[str, tuple[str, str]] = {}
    for path in paths:
        for key, (value, where) in read_conf(path).items():
            if key in entries and entries[key][0] != value:
                raise ValueError(f"{key}: {where} says {value!r} but {entries[key][1]} says {entries[key][0]!r}")
            entries.setdefault(key, (value, where))
    fields, notes = conf_settings(entries)
    fields.update({k: v for k, v in flags.items() if v is not None})
    try:
        return MetaStoreConfig(**fields, sources=tuple(str(p) for p in paths)), notes
    except ValidationError as e:
        err = e.errors()[0]
        name = ".".join(str(x) for x in err["loc"])
        raise ValueError(f"{name}: {err['msg']}, got {err.get('input')!r}") from None
