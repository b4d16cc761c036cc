"""The prefill's loader thread: slots acquired and prefixes loaded ahead of the compute.

For one chunk, ``SlotLoader`` walks the cache layers in order: it acquires each layer's slot from
the gates (the slot's previous occupant saved, read and computed) and loads the cached prefix into
it, at most ``ahead`` layers before the compute takes them. Every failure settles the tickets it
leaves behind (``fail_ticket``), so no slot stays held (I4, I6).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future

from kvcore.gates import GateSet
from kvcore.slottickets import SlotTicket
from kvoffload_engine.buffers import LayerBuffers


def fail_ticket(ticket: SlotTicket, exc: BaseException, *, compute: bool, save: bool, reads: bool) -> None:
    """Settle whatever ``ticket`` will now never do, so its slot frees once the rest settles."""
    if compute:
        ticket.compute_failed(exc)
    if save:
        ticket.save_failed(exc)
    if reads:
        for reader in ticket.readers:
            ticket.read_failed(reader, f"prefill failed before announcing: {exc}")


class SlotLoader:
    """Acquires slots (for ``readers``, as ``owner``) and loads prefixes (``load(ticket)``) of the
    ``num_layers`` layers in order, at most ``ahead`` layers ahead of ``take``, on ``thread`` (the
    engine's one loader thread: a thread started per chunk cost the compute's thread its start)."""

    def __init__(
        self,
        thread: Executor,
        gates: GateSet,
        buffers: LayerBuffers,
        num_layers: int,
        ahead: int,
        readers: frozenset[Hashable],
        owner: Hashable,
        load: Callable[[SlotTicket], None],
    ) -> None:
        self.gates, self.buffers, self.readers, self.owner, self.load = gates, buffers, readers, owner, load
        self._futures: list[Future] = [Future() for _ in range(num_layers)]
        self._permits = threading.Semaphore(ahead)
        self._stop = threading.Event()
        self._taken = 0
        self._done = thread.submit(self._work)

    def _work(self) -> None:
        for layer, fut in enumerate(self._futures):
            self._permits.acquire()
            if self._stop.is_set():
                fut.set_exception(RuntimeError("prefill aborted"))
                continue
            try:
                ticket = self.gates.acquire(layer, self.readers, owner=self.owner)
            except BaseException as exc:  # noqa: BLE001 - raised where the compute waits on this layer's future
                fut.set_exception(exc)
                continue
            try:
                self.load(ticket)
            except BaseException as exc:  # noqa: BLE001 - raised where the compute waits on this layer's future
                self.buffers.forget(layer)
                fail_ticket(ticket, exc, compute=True, save=True, reads=True)
                fut.set_exception(exc)
                continue
            fut.set_result(ticket)

    def take(self, layer: int) -> SlotTicket:
        """The ticket of ``layer`` once its prefix is loaded (raises the loader's error)."""
        if layer != self._taken:
            raise RuntimeError(f"layers must be taken in order: expected {self._taken}, got {layer}")
        self._taken += 1
        try:
            return self._futures[layer].result()
        finally:
            self._permits.release()

    def abort(self, exc: BaseException) -> None:
        """Stop loading and settle tickets acquired for layers that will not run."""
        self._stop.set()
        for _ in self._futures:
            self._permits.release()
        self._done.result()
        for fut in self._futures[self._taken :]:
            if fut.exception() is None:
                ticket = fut.result()
                self.buffers.forget(ticket.layer)
                fail_ticket(ticket, exc, compute=True, save=True, reads=True)

    def finish(self) -> None:
        self._done.result()
