"""The transfer engines a P→D pull may run on instead of the embedded data path: those of the
``kvcore.transferregistry`` entries that name an engine factory (``"memfabric"``: ``pdlink.memfabric``;
``"mooncake"``: ``pdlink.mooncake_transfer``). ``start_engine`` starts this process's engine through its
entry's factory (imported then), ``register_segment`` publishes the prefill's layer-buffer segment
through it; where either cannot run (the engine module's ``EngineCannotRun``, or a bad argument) they
raise ``EngineUnavailable`` with the engine's own reason, and the service stops (exit 2): never the
embedded path instead."""

from __future__ import annotations

from typing import Any

from kvcore.pool.registry import load
from kvcore.transferregistry import ENGINE_TRANSFERS, TRANSFERS
from pdlink.engine_rows import EngineCannotRun, Transfer

_CANNOT_RUN = (EngineCannotRun, ValueError)


class EngineUnavailable(RuntimeError):
    """The transfer engine a config names cannot start (or register memory) here."""


def start_engine(backend: str, role: str, host: str, d2h: Any) -> Transfer:
    """This process's engine of transfer_backend ``backend`` (one of ``ENGINE_TRANSFERS``) at ``host``
    for ``role`` ("Prefill" or "Decode"); ``d2h`` is the D2H connector config (the backend's keys), or
    None (the vLLM connector: the backend's defaults). ValueError for a backend with no engine."""
    entry = TRANSFERS.get(backend)
    if entry is None or entry.engine is None:
        raise ValueError(f"transfer_backend {backend!r} has no transfer engine; engines: {', '.join(ENGINE_TRANSFERS)}")
    factory = load(entry.engine)
    try:
        transfer: Transfer = factory(role, host, d2h)
    except _CANNOT_RUN as e:
        raise EngineUnavailable(f"transfer_backend {backend!r}: {e}") from None
    return transfer


def register_segment(transfer: Transfer, address: int, nbytes: int) -> None:
    """Publish ``nbytes`` at ``address`` (the prefill's layer-buffer segment) through ``transfer``."""
    try:
        transfer.register(address, nbytes)
    except _CANNOT_RUN as e:
        raise EngineUnavailable(f"transfer_backend {transfer.name!r}: {e}") from None
