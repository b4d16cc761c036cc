"""transfer_backend ``"mooncake"``: the P→D layer pull over Mooncake Transfer Engine
(``mooncake.engine.TransferEngine`` of the ``mooncake-transfer-engine-non-cuda`` wheel, 0.3.x).
``MooncakeTransfer`` is one started engine (both sides); the decode reads through it with
``pdlink.engine_rows.EngineRows``, as with memfabric.

How the engine pairs the two sides (its Python binding and the messages it logs):

- ``initialize(local_hostname, metadata_server, protocol, device_name)``: with ``metadata_server``
  ``"P2PHANDSHAKE"`` no metadata service runs anywhere: every engine listens on an RPC port of its
  own (``get_rpc_port`` after ``initialize``), and a reader fetches the peer's segment descriptor
  (what it registered) from that port on its first transfer with it. The session peers name is
  therefore "HOST:RPC_PORT"; the prefill advertises its session and the address of its registered
  layer-buffer segment in ``LayoutMetadata`` (``engine_session``, ``engine_segment_address``).
- ``protocol`` ``"tcp"``: the engine's TCP transport, on any host (``device_name`` unused). (RDMA
  needs NICs this code has not been run on: not offered yet.)
- ``register_memory(address, length)``: memory a peer may read (the prefill's segment) or a read may
  land in (the decode's staging buffer); ``batch_transfer_sync_read(session, local, peer, lengths)``
  copies every range in one batch and returns 0, or a negative number.

Failures. The engine returns only numbers; its reasons are glog lines on stderr ("E1203 ...
file.cpp:123] message"). The start-up calls run with file descriptors 1 and 2 captured
(``svcruntime.native_output``; the bytes are written back afterwards) and raise
``MooncakeUnavailable`` naming the call, its return code and the engine's own error lines. A
failed read (a dead peer: "connect() ...: Connection refused") is a ``MooncakeError``; its reason
stays in the process's log (reads are not captured: they run on many threads at once).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from kvcore.pool.registry import MOONCAKE_INSTALL
from pdlink.engine_rows import EngineCannotRun, check_ranges
from svcruntime.native_output import error_lines, native_output

log = structlog.get_logger(__name__)

MODULE = "mooncake.engine"
P2P_HANDSHAKE = "P2PHANDSHAKE"  # no metadata server: peers handshake on each engine's RPC port
PROTOCOL = "tcp"

# Every engine this process started, kept until it exits: a TransferEngine's destructor blocks for
# about a second holding the GIL (1.1 s measured, binding 0.3.x), which would stall every Python
# thread of the process (gRPC servers, heartbeats) whenever a closed engine is collected.
_STARTED: list[Any] = []

_ERROR_LINE = re.compile(
    r"^[EF]\d{4} [\d:.]+\s+\d+ (?P<src>[\w.]+:\d+)\] (?P<msg>.*)$"
)  # glog: "E1203 18:47:11.11 4742 f.cpp:9] msg"


class MooncakeNotInstalled(ImportError, EngineCannotRun):
    """``mooncake.engine`` cannot be imported."""


class MooncakeError(RuntimeError):
    """A Transfer Engine call failed: ``code`` is what it returned."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


class MooncakeUnavailable(MooncakeError, EngineCannotRun):
    """A start-up call failed: the engine cannot run (or register memory) here."""


def import_engine() -> Any:
    """``mooncake.engine.TransferEngine``, or ``MooncakeNotInstalled`` saying what to install."""
    try:
        from mooncake.engine import TransferEngine
    except Exception as e:  # a broken install raises more than ImportError (missing shared libraries)
        raise MooncakeNotInstalled(f"cannot import {MODULE} ({type(e).__name__}: {e}); {MOONCAKE_INSTALL}") from e
    return TransferEngine


def native_reason(lines: Sequence[str]) -> str:
    """The engine's error lines, the first of each source line: ``msg (file:line)``, joined by "; "."""
    return error_lines(lines, _ERROR_LINE)


def _checked(call: str, fn: Callable[[], int]) -> None:
    """Run a start-up call with its native output captured; MooncakeUnavailable unless it returns 0."""
    with native_output() as lines:
        code = int(fn())
    if code != 0:
        reason = native_reason(lines) or "it logged no error line"
        raise MooncakeUnavailable(f"{MODULE} cannot start here: {call} returned {code}; it says: {reason}", code=code)


def _check_host(host: str) -> str:
    if not isinstance(host, str) or not host or host.strip() != host or ":" in host or host == "0.0.0.0":
        raise ValueError(
            f"host must be the IPv4 address or name peers reach this process at (the session it advertises), "
            f"not a wildcard or an IPv6 address, got {host!r}"
        )
    return host


class MooncakeTransfer:
    """This process's started Transfer Engine (see the module docstring). ``session`` ("HOST:PORT") is
    what peers read from; ``register`` publishes host memory; ``read`` copies ranges of a peer
    session's registered memory into local registered memory in one batched sync read; ``close``
    unregisters it all. The engine itself lives as long as the process (``_STARTED``)."""

    name = "mooncake"

    def __init__(self, engine: Any, session: str) -> None:
        self._engine, self.session = engine, session
        self._registered: list[int] = []
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def start(cls, host: str) -> MooncakeTransfer:
        """Initialize an engine at ``host`` (P2P handshake, TCP). ValueError for a bad host,
        MooncakeNotInstalled, or MooncakeUnavailable with the engine's own reason."""
        host = _check_host(host)
        engine = import_engine()()
        _STARTED.append(engine)
        call = f"TransferEngine.initialize({host!r}, {P2P_HANDSHAKE!r}, {PROTOCOL!r}, '')"
        _checked(call, lambda: engine.initialize(host, P2P_HANDSHAKE, PROTOCOL, ""))
        port = int(engine.get_rpc_port())
        if port <= 0:
            raise MooncakeUnavailable(
                f"{MODULE} cannot start here: TransferEngine.get_rpc_port() returned {port} after {call} succeeded",
                code=port,
            )
        transfer = cls(engine, f"{host}:{port}")
        log.info("mooncake_transfer_started", session=transfer.session, protocol=PROTOCOL)
        return transfer

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError(f"mooncake session {self.session} is closed")

    def register(self, address: int, nbytes: int) -> None:
        """Publish ``nbytes`` of host memory at ``address`` to peers; MooncakeUnavailable if refused."""
        if address <= 0 or nbytes <= 0:
            raise ValueError(f"register needs an address and a size > 0, got 0x{address:x} and {nbytes}")
        self._open()
        _checked(
            f"TransferEngine.register_memory(0x{address:x}, {nbytes}) of session {self.session}",
            lambda: self._engine.register_memory(address, nbytes),
        )
        self._registered.append(address)

    def read(self, peer_session: str, local: Sequence[int], peer: Sequence[int], lengths: Sequence[int]) -> None:
        """Copy ``lengths[i]`` bytes at ``peer[i]`` (registered by ``peer_session``) to ``local[i]``
        (registered here) with one batched sync read; MooncakeError if it fails."""
        check_ranges(local, peer, lengths)
        self._open()
        code = int(self._engine.batch_transfer_sync_read(peer_session, list(local), list(peer), list(lengths)))
        if code != 0:
            raise MooncakeError(
                f"{MODULE} TransferEngine.batch_transfer_sync_read from session {peer_session} "
                f"({len(lengths)} ranges, {sum(lengths)} bytes) returned {code} (its log on stderr says why)",
                code=code,
            )

    def close(self) -> None:
        """Unregister the registered memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for address in reversed(self._registered):
            code = self._engine.unregister_memory(address)
            if code != 0:
                log.warning("mooncake_unregister_failed", session=self.session, address=hex(address), code=code)
        log.info("mooncake_transfer_closed", session=self.session)


def start_transfer(role: str, host: str, d2h: Any) -> MooncakeTransfer:
    """transfer_backend "mooncake"'s engine factory (its ``kvcore.transferregistry`` entry): this
    process's engine at ``host``, the same for either ``role``; ``d2h`` has no key of Mooncake's."""
    del role, d2h  # both sides start alike, and Mooncake takes no connector key
    return MooncakeTransfer.start(host)
