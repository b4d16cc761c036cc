"""``MemcacheClient``: one started Memcache LocalService (``memcache_hybrid.DistributedObjectStore``)
with typed calls, and start-up failures turned into errors that name their cause.

Start-up. ``MemcacheClient.connect(local_config)`` builds a ``LocalConfig`` from an
``mmc-local.conf`` (``poolbackends.memcache_conf.local_fields``), calls ``setup`` and then
``init(device_id, init_bm)``. With ``contribute_memory=True`` (``init_bm``) the LocalService
contributes ``dram.size`` of host memory to the pool through MemFabric (``memfabric_hybrid``'s
"hybm" layer): that is the data path, and it needs an Ascend NPU driver for every protocol,
``host_shm`` and ``host_tcp`` included. Without one, memcache_hybrid 1.3.0 prints
"the current version of ascend driver does not support mf!" and ``init`` returns -1 after about
2 s. ``init`` reports only a number; the reason is in the library's log lines, which it writes to
the process's stdout. So ``connect`` captures file descriptors 1 and 2 during ``init``
(``svcruntime.native_output``; the bytes are written back afterwards) and raises
``MemcacheUnavailable`` whose ``reason`` is the library's own error lines, and whose
``needs_ascend_driver`` says whether the driver is the cause. ``contribute_memory=False`` starts
a metadata-only client (it runs here; puts then fail: no LocalService memory to place them in).

One LocalService per process. memcache_hybrid keeps its set-up state for the life of the process:
until every client it started is closed, a second ``setup`` is ignored ("mmc is already setup"),
and after an ``init`` that failed it is ignored for good; the LocalService then keeps dialling the
config store it was first given, for minutes, when that MetaService is gone. So ``connect`` records
the MetaService and config store of the process's ``setup`` and refuses, at once, a ``connect`` to
another pair while that one holds (``MemcacheUnavailable``): start that client in another process.

Calls (not run here: they need a started data path). Batches of ``str`` keys, one code per key
(0: success, else memcache_hybrid's error code): ``put_layers`` / ``get_layers`` (one object =
several memory ranges, ``batch_put_from_layers`` / ``batch_get_into_layers`` with host-memory copy
directions H2G / G2H), ``exists`` (1, 0, or < 0), ``remove``, ``add_lease`` / ``remove_lease``
(the MetaService's read lease), ``register`` / ``unregister`` of host buffers.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from kvcore.config.mmc_files import mmc_pair
from kvcore.pool.host_pool import PoolError
from poolbackends.memcache_conf import LocalSettings, local_fields
from poolbackends.memcache_meta import INSTALL_HINT, MODULE, MemcacheNotInstalled
from svcruntime.native_output import native_output

H2G = 3  # memfabric_hybrid.bm.BmCopyType.H2G: host memory -> global pool
G2H = 2  # BmCopyType.G2H: global pool -> host memory
DRIVER_HINT = (
    "The Memcache data path (MemFabric's hybm layer under every ock.mmc.local_service.protocol) needs "
    "an Ascend NPU driver (Ascend HDK) on this host; kvoffload does not fall back to its embedded pool"
)

_setup_lock = threading.Lock()
_process_setup: tuple[str, str] | None = None  # (meta_service_url, config_store_url) of this process's setup
_open_clients = 0  # started clients not yet closed; at 0 the setup is released ...
_init_failed = False  # ... unless an init of this process failed: then the library keeps it for good
_LINE = re.compile(r"\b(ERROR|error|WARN|warning)\b.*?\[(\w+) ([\w.]+:\d+) (\w+)\] (.*)$")


class MemcacheUnavailable(RuntimeError):
    """memcache_hybrid imports but its LocalService cannot start here; ``reason`` is the library's own
    account (its error log lines), ``code`` what ``init`` returned."""

    def __init__(self, message: str, *, reason: str, code: int, needs_ascend_driver: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code
        self.needs_ascend_driver = needs_ascend_driver


class MemcacheStoreError(PoolError):
    """A Memcache call failed; ``code`` is memcache_hybrid's return code."""

    def __init__(self, message: str, *, code: int, key: bytes | None = None) -> None:
        super().__init__(message, key=key)
        self.code = code


def import_memcache() -> Any:
    """The ``memcache_hybrid`` module, or ``MemcacheNotInstalled`` saying what to install."""
    try:
        import memcache_hybrid
    except Exception as e:  # a broken install raises more than ImportError (missing shared libraries)
        raise MemcacheNotInstalled(f"cannot import {MODULE} ({type(e).__name__}: {e}); {INSTALL_HINT}") from e
    return memcache_hybrid


def native_reason(lines: list[str]) -> str:
    """The library's error lines (and driver warnings), one per source line: ``msg (TAG file:line)``."""
    seen: set[str] = set()
    out = []
    for line in lines:
        m = _LINE.search(line)
        if m is None:
            continue
        level, tag, where, msg = m.group(1).upper(), m.group(2), m.group(3), m.group(5).strip()
        if (level.startswith("WARN") and "driver" not in msg.lower()) or where in seen:
            continue
        seen.add(where)
        out.append(f"{msg} ({tag} {where})")
    return "; ".join(out)


def build_local_config(mmc: Any, fields: dict[str, Any]) -> Any:
    """A ``memcache_hybrid.LocalConfig`` with ``fields`` (``memcache_conf.local_fields``) set."""
    config = mmc.LocalConfig()
    for field, value in fields.items():
        setattr(config, field, value)
    return config


def _client_closed() -> None:
    global _process_setup, _open_clients
    with _setup_lock:
        _open_clients -= 1
        if _open_clients == 0 and not _init_failed:
            _process_setup = None


class MemcacheClient:
    """One started LocalService client (see the module docstring). Thread-safe as the library is."""

    def __init__(
        self, store: Any, local_config: str, fields: dict[str, Any], contributes_memory: bool, owns_conf: bool = False
    ) -> None:
        self._store = store
        self.local_config = local_config
        self._owns_conf = owns_conf
        self.meta_service_url = str(fields.get("meta_service_url", "tcp://127.0.0.1:5000"))
        self.protocol = str(fields.get("protocol", "host_rdma"))
        self.contributes_memory = contributes_memory
        self._closed = False

    @classmethod
    def connect(
        cls, local_config: str | os.PathLike[str] | LocalSettings, *, device_id: int = 0, contribute_memory: bool = True
    ) -> MemcacheClient:
        """Start a LocalService from an ``mmc-local.conf`` path (or settings, written to a temporary
        file first). Raises ``MemcacheNotInstalled``, ``ValueError`` (a bad conf, or one that breaks the
        pair rules against ``$MMC_META_CONFIG_PATH``: ``kvcore.config.mmc_files.mmc_pair``) or
        ``MemcacheUnavailable`` (the library refused to start: the reason is its own)."""
        if not isinstance(device_id, int) or device_id < 0:
            raise ValueError(f"device_id must be an int >= 0, got {device_id!r}")
        mmc = import_memcache()
        if isinstance(local_config, LocalSettings):
            fd, path = tempfile.mkstemp(prefix="mmc-local-", suffix=".conf")
            with os.fdopen(fd, "w") as f:
                f.write(local_config.conf_text())
        else:
            path = os.fspath(local_config)
            mmc_pair(local_config=path)  # the same MetaService and config store as $MMC_META_CONFIG_PATH's
        owns_conf = isinstance(local_config, LocalSettings)
        try:
            return cls._start(mmc, path, device_id, contribute_memory, owns_conf)
        except BaseException:
            if owns_conf:
                os.unlink(path)
            raise

    @classmethod
    def _start(cls, mmc: Any, path: str, device_id: int, contribute_memory: bool, owns_conf: bool) -> MemcacheClient:
        global _process_setup, _open_clients, _init_failed
        fields = local_fields(path)
        wanted = (str(fields.get("meta_service_url", "tcp://127.0.0.1:5000")), str(fields.get("config_store_url", "")))
        with _setup_lock:
            if _process_setup is not None and _process_setup != wanted:
                reason = (
                    f"this process already set up its LocalService for MetaService {_process_setup[0]} "
                    f"(config store {_process_setup[1]}); {MODULE} keeps one per process"
                )
                raise MemcacheUnavailable(
                    f"{MODULE} cannot start a LocalService for MetaService {wanted[0]} (config "
                    f"store {wanted[1]}, conf {path}): {reason}. Connect from another process",
                    reason=reason,
                    code=-1,
                    needs_ascend_driver=False,
                )
            store = mmc.DistributedObjectStore()
            code = store.setup(build_local_config(mmc, fields))
            if code != 0:
                raise MemcacheUnavailable(
                    f"{MODULE} DistributedObjectStore.setup(LocalConfig from {path}) returned {code}",
                    reason=f"setup returned {code}",
                    code=code,
                    needs_ascend_driver=False,
                )
            _process_setup = wanted  # kept after a failed init: the library keeps it too
        with native_output() as lines:
            code = store.init(device_id, contribute_memory)
        if code != 0:
            _init_failed = True
            reason = native_reason(lines) or f"{MODULE} printed no reason (set ock.mmc.log_level = debug in {path})"
            driver = "driver" in reason.lower()
            proto = fields.get("protocol", "host_rdma")
            raise MemcacheUnavailable(
                f"{MODULE} cannot start its LocalService here: DistributedObjectStore.init(device_id={device_id}, "
                f"init_bm={contribute_memory}) returned {code} (protocol {proto}, MetaService "
                f"{fields.get('meta_service_url', 'tcp://127.0.0.1:5000')}, conf {path}). {MODULE} says: {reason}"
                + (f". {DRIVER_HINT}" if driver else ""),
                reason=reason,
                code=code,
                needs_ascend_driver=driver,
            )
        with _setup_lock:
            _open_clients += 1
        return cls(store, path, fields, contribute_memory, owns_conf)

    def _check(self) -> Any:
        if self._closed:
            raise PoolError(f"Memcache client of {self.meta_service_url} is closed")
        return self._store

    @property
    def service_id(self) -> int:
        """This LocalService's id at the MetaService."""
        return int(self._check().get_local_service_id())

    def register(self, ptr: int, size: int) -> int:
        return int(self._check().register_buffer(ptr, size))

    def unregister(self, ptr: int, size: int) -> int:
        return int(self._check().unregister_buffer(ptr, size))

    def put_layers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Put each object ``keys[i]`` from the host ranges ``ptrs[i]`` / ``sizes[i]`` (in order)."""
        return list(
            self._check().batch_put_from_layers(list(keys), [list(p) for p in ptrs], [list(s) for s in sizes], H2G)
        )

    def get_layers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Read each object ``keys[i]`` into the host ranges ``ptrs[i]`` / ``sizes[i]`` (in order)."""
        return list(
            self._check().batch_get_into_layers(list(keys), [list(p) for p in ptrs], [list(s) for s in sizes], G2H)
        )

    def exists(self, keys: Sequence[str]) -> list[int]:
        """Per key 1 (exists), 0 (not), or < 0 (error)."""
        return list(self._check().batch_is_exist(list(keys))) if keys else []

    def remove(self, keys: Sequence[str]) -> list[int]:
        return list(self._check().remove_batch(list(keys))) if keys else []

    def add_lease(self, keys: Sequence[str], ttl_ms: int) -> list[int]:
        return list(self._check().batch_add_lease(list(keys), ttl_ms)) if keys else []

    def remove_lease(self, keys: Sequence[str]) -> int:
        return int(self._check().batch_remove_lease(list(keys))) if keys else 0

    def close(self) -> None:
        """Stop the LocalService (its contributed memory leaves the pool). Idempotent."""
        if not self._closed:
            self._closed = True
            self._store.close()
            _client_closed()
            if self._owns_conf:
                os.unlink(self.local_config)

    def __enter__(self) -> MemcacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"MemcacheClient({self.meta_service_url}, protocol={self.protocol}, {'closed' if self._closed else 'open'})"
        )
