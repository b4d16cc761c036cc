"""transfer_backend ``"memfabric"``: the P→D layer pull over memfabric_hybrid 1.3.0's ``TransferEngine``.
``MemfabricTransfer`` is one started engine (both sides); the decode reads through it with
``pdlink.engine_rows.EngineRows``, as with Mooncake.

How memfabric_hybrid 1.3.0 pairs the two sides (its Python API docs and the log strings of its
binding; a host without an Ascend driver fails ``initialize`` before any of it):

- Roles. ``initialize(store_url, session_id, role, device_id, data_op_type, store_server_role)``:
  the engine whose ``role`` equals ``store_server_role`` creates a config store itself, at its own
  session address, and publishes the memory it registers there; any other engine is a store client
  that joins a peer session's store on its first transfer with it. The decode reads from the
  prefill (``batch_transfer_sync_read``), so the prefill is the store server on both sides
  (``STORE_SERVER_ROLE``); no separate store (``create_config_store``) is needed.
- Addresses. Only the protocol of ``store_url`` is used (``tcp://``; its host and port are not).
  ``session_id`` is the host peers reach this process at; memfabric picks the port (a free one in
  ``$MF_CONFIG_STORE_PORT_START``..``$MF_CONFIG_STORE_PORT_END``, default 9000..65535) and
  ``get_rpc_port`` returns it after ``initialize``. The prefill advertises its session "HOST:PORT"
  and the address of its registered layer-buffer segment in ``LayoutMetadata`` (``engine_session``,
  ``engine_segment_address``).

Failures. memfabric's calls return only a number; the reason is in its log lines, which it prints
to stdout (the binding's own ADAPTER lines included). The start-up calls (``initialize``,
``register_memory``) run with file descriptors 1 and 2 captured (``native_output``; the bytes are
written back afterwards) and raise ``MemfabricUnavailable`` naming the call, its return code and
memfabric's own ERROR lines. (``set_extern_logger`` is not used: it misses the ADAPTER lines, and
it is process-wide and cannot be undone, so it would also divert the lines memcache_hybrid, over
the same native library, prints for ``poolbackends.memcache_client`` to parse.) Without an Ascend
driver 1.3.0's ``initialize`` returns -1 saying "check driver version failed", "the current
version of ascend driver does not support mf!", "hybm core init failed: -1". A missing module is
``MemfabricNotInstalled``, naming what to install.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from kvcore.config.names import MEMFABRIC_DATA_OPS
from kvcore.transferregistry import MEMFABRIC_INSTALL
from pdlink.engine_rows import EngineCannotRun, check_ranges
from svcruntime.native_output import error_lines, native_output

log = structlog.get_logger(__name__)

MODULE = "memfabric_hybrid"
ROLES = ("Prefill", "Decode")
STORE_SERVER_ROLE = "Prefill"  # the prefill's engine hosts the config store; the decode's joins it
STORE_PROTOCOL = "tcp://"
DRIVER_HINT = (
    "memfabric's data path needs an Ascend NPU driver (Ascend HDK) on this host; kvoffload does not fall "
    "back to its embedded P→D data path"
)

_ERROR_LINE = re.compile(
    r"\bERROR\b.*?\[(?P<src>\w+ [\w.]+:\d+) \w+\] (?P<msg>.*)$"
)  # "... ERROR [pid-tid][TAG file:line fn] msg"


class MemfabricNotInstalled(ImportError, EngineCannotRun):
    """``memfabric_hybrid`` cannot be imported."""


class MemfabricError(RuntimeError):
    """A memfabric call failed: ``code`` is what it returned, ``reason`` memfabric's own account ("" if none)."""

    def __init__(self, message: str, *, code: int, reason: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


class MemfabricUnavailable(MemfabricError, EngineCannotRun):
    """A start-up call failed: the engine cannot run (or register memory) here."""

    @property
    def needs_ascend_driver(self) -> bool:
        return "driver" in self.reason.lower()


def import_memfabric() -> Any:
    """The ``memfabric_hybrid`` module, or ``MemfabricNotInstalled`` saying what to install."""
    try:
        import memfabric_hybrid
    except Exception as e:  # a broken install raises more than ImportError (missing shared libraries)
        raise MemfabricNotInstalled(f"cannot import {MODULE} ({type(e).__name__}: {e}); {MEMFABRIC_INSTALL}") from e
    return memfabric_hybrid


def native_reason(lines: Sequence[str]) -> str:
    """memfabric's ERROR lines, the first of each source line: ``msg (TAG file:line)``, joined by "; "."""
    return error_lines(lines, _ERROR_LINE)


def _last_error(mf: Any) -> str:
    return str(mf.get_and_clear_last_err_msg() or "").strip()


def _checked(mf: Any, call: str, fn: Callable[[], int]) -> None:
    """Run a start-up call with its native output captured; MemfabricUnavailable unless it returns 0."""
    with native_output() as lines:
        code = int(fn())
    if code == 0:
        return
    reason = (
        "; ".join(r for r in (native_reason(lines), _last_error(mf)) if r)
        or f"{MODULE} printed no reason (set ASCEND_MF_LOG_LEVEL=0 for its debug log)"
    )
    driver = "driver" in reason.lower()
    raise MemfabricUnavailable(
        f"{MODULE} cannot start here: {call} returned {code}; {MODULE} says: {reason}"
        + (f"; {DRIVER_HINT}" if driver else ""),
        code=code,
        reason=reason,
    )


def _session_host(host: str) -> str:
    if not isinstance(host, str) or not host or host.strip() != host:
        raise ValueError(f"host must be the address peers reach this process at, got {host!r}")
    return f"[{host}]" if ":" in host and not host.startswith("[") else host  # IPv6 as memfabric parses it


class MemfabricTransfer:
    """This process's started TransferEngine (see the module docstring). ``session`` ("HOST:PORT") is
    what peers read from; ``register`` publishes host memory (the prefill's layer-buffer segment, the
    decode's staging buffer); ``read`` copies ranges of a peer session's registered memory into local
    registered memory in one batched sync read; ``close`` releases it all, in order."""

    name = "memfabric"

    def __init__(self, mf: Any, engine: Any, role: str, session: str) -> None:
        self._mf, self._engine = mf, engine
        self.role, self.session = role, session
        self._registered: list[int] = []
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def start(cls, role: str, host: str, *, device_id: int = 0, data_op: str = "sdma") -> MemfabricTransfer:
        """Initialize an engine for ``role`` ("Prefill" or "Decode") at ``host``, on NPU ``device_id``,
        with ``data_op`` (one of ``MEMFABRIC_DATA_OPS``). ValueError for bad arguments,
        MemfabricNotInstalled, or MemfabricUnavailable with memfabric's own reason."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise ValueError(f"device_id must be an int >= 0, got {device_id!r}")
        if data_op not in MEMFABRIC_DATA_OPS:
            raise ValueError(f"data_op must be one of {MEMFABRIC_DATA_OPS}, got {data_op!r}")
        session_host = _session_host(host)
        mf = import_memfabric()
        op = getattr(mf.TransDataOpType, data_op.upper())
        store_url = STORE_PROTOCOL + session_host
        engine = mf.TransferEngine()
        call = (
            f"TransferEngine.initialize(store_url={store_url!r}, session_id={session_host!r}, role={role!r}, "
            f"device_id={device_id}, data_op_type={op.name}, store_server_role={STORE_SERVER_ROLE!r})"
        )
        _checked(mf, call, lambda: engine.initialize(store_url, session_host, role, device_id, op, STORE_SERVER_ROLE))
        port = int(engine.get_rpc_port())
        transfer = cls(mf, engine, role, f"{session_host}:{port}")
        if port <= 0:
            transfer.close()
            raise MemfabricUnavailable(
                f"{MODULE} cannot start here: TransferEngine.get_rpc_port() returned {port} after {call} succeeded",
                code=port,
                reason=_last_error(mf),
            )
        log.info("memfabric_started", role=role, session=transfer.session, device_id=device_id, data_op=data_op)
        return transfer

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError(f"memfabric session {self.session} is closed")

    def register(self, address: int, nbytes: int) -> None:
        """Publish ``nbytes`` of host memory at ``address`` to peers; MemfabricUnavailable if refused."""
        if address <= 0 or nbytes <= 0:
            raise ValueError(f"register needs an address and a size > 0, got 0x{address:x} and {nbytes}")
        self._open()
        _checked(
            self._mf,
            f"TransferEngine.register_memory(0x{address:x}, {nbytes}) of session {self.session}",
            lambda: self._engine.register_memory(address, nbytes),
        )
        self._registered.append(address)

    def read(self, peer_session: str, local: Sequence[int], peer: Sequence[int], lengths: Sequence[int]) -> None:
        """Copy ``lengths[i]`` bytes at ``peer[i]`` (registered by ``peer_session``) to ``local[i]``
        (registered here) with one batched sync read; MemfabricError if it fails."""
        check_ranges(local, peer, lengths)
        self._open()
        code = int(self._engine.batch_transfer_sync_read(peer_session, list(local), list(peer), list(lengths)))
        if code != 0:
            reason = _last_error(self._mf)
            raise MemfabricError(
                f"{MODULE} TransferEngine.batch_transfer_sync_read from session {peer_session} "
                f"({len(lengths)} ranges, {sum(lengths)} bytes) returned {code}"
                + (f": {reason}" if reason else " (its log on stdout says why)"),
                code=code,
                reason=reason,
            )

    def close(self) -> None:
        """Unregister the registered memory, destroy the engine, uninitialize memfabric. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for address in reversed(self._registered):
            code = self._engine.unregister_memory(address)
            if code != 0:
                log.warning("memfabric_unregister_failed", session=self.session, address=hex(address), code=code)
        self._engine.destroy()
        self._engine.unInitialize()
        log.info("memfabric_closed", role=self.role, session=self.session)


def start_transfer(role: str, host: str, d2h: Any) -> MemfabricTransfer:
    """transfer_backend "memfabric"'s engine factory (its ``kvcore.transferregistry`` entry): this
    process's engine for ``role`` at ``host``, on the NPU and with the data operation ``d2h`` (the D2H
    connector config) names; memfabric's defaults when ``d2h`` is None."""
    if d2h is None:
        return MemfabricTransfer.start(role, host)
    return MemfabricTransfer.start(role, host, device_id=d2h.memfabric_device_id, data_op=d2h.memfabric_data_op)
