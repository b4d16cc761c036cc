"""The transfer engines a P→D pull may run on instead of the embedded data path (transfer_backend
``"memfabric"``: ``pdlink.memfabric``; ``"mooncake"``: ``pdlink.mooncake``). ``start_engine``
starts this process's engine, ``register_segment`` publishes the prefill's layer-buffer segment
through it; where either cannot run they raise ``EngineUnavailable`` with the engine's own reason,
and the service stops (exit 2): never the embedded path instead."""

from __future__ import annotations

from typing import Any

from pdlink.engine_rows import Transfer
from pdlink.memfabric import MemfabricNotInstalled, MemfabricTransfer, MemfabricUnavailable
from pdlink.mooncake import MooncakeNotInstalled, MooncakeTransfer, MooncakeUnavailable

ENGINES = ("memfabric", "mooncake")  # the transfer_backend values with a transfer engine
_CANNOT_RUN = (MemfabricUnavailable, MemfabricNotInstalled, MooncakeUnavailable, MooncakeNotInstalled, ValueError)


class EngineUnavailable(RuntimeError):
    """The transfer engine a config names cannot start (or register memory) here."""


def start_engine(backend: str, role: str, host: str, d2h: Any) -> Transfer:
    """This process's engine of transfer_backend ``backend`` (one of ``ENGINES``) at ``host`` for
    ``role`` ("Prefill" or "Decode"); ``d2h`` is the D2H connector config (memfabric's keys)."""
    try:
        if backend == "memfabric":
            return MemfabricTransfer.start(role, host, device_id=d2h.memfabric_device_id, data_op=d2h.memfabric_data_op)
        if backend == "mooncake":
            return MooncakeTransfer.start(host)
    except _CANNOT_RUN as e:
        raise EngineUnavailable(f"transfer_backend {backend!r}: {e}") from None
    raise ValueError(f"transfer_backend {backend!r} has no transfer engine; engines: {', '.join(ENGINES)}")


def register_segment(transfer: Transfer, address: int, nbytes: int) -> None:
    """Publish ``nbytes`` at ``address`` (the prefill's layer-buffer segment) through ``transfer``."""
    try:
        transfer.register(address, nbytes)
    except _CANNOT_RUN as e:
        raise EngineUnavailable(f"transfer_backend {transfer.name!r}: {e}") from None
