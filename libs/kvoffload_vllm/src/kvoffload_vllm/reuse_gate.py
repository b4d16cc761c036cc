"""The reuse gate of shared layer buffers inside a vLLM worker (invariant I4).

A layer's KV in a shared buffer is still being read after its attention: the store's saver copies
it to host memory, a decode pulls it through the D2H producer's LayerSource. Each of those holds
the layer here for as long as it reads (``hold`` ... ``release``), with a deadline it promises to
keep (the saver: ``SAVE_BOUND_S``; a pull: the D2H read timeout, after which the producer answers
the read failed). The next layer of the same buffer waits in ``wait_free`` before anything is
written into it; a hold past its deadline is a bug somewhere and the wait fails loudly
(``ReuseTimeout`` naming the layer and its holders), never a silent overwrite. A wait that lasts
``HELD_LOG_S`` says so once (``kvoffload_shared_gate_held``: the waiter, the layer it waits for and
its holders), so a prefill held by a slow save or a stalled decode's pull is visible while it waits.

One gate per worker process (``GATE``): the store and the D2H connector are separate connectors
of one vLLM worker and meet here.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import structlog

log = structlog.get_logger("vllm.kvoffload.store")

SAVE_BOUND_S = 120.0  # a host copy of one layer's blocks; far beyond any real one
GRACE_S = 5.0  # past the latest deadline before the wait gives up
HELD_LOG_S = 0.1  # a wait this long is logged once (far above a wait for a save that is finishing)


class ReuseTimeout(RuntimeError):
    """A buffer's previous occupant is still held past its deadline."""


class ReuseGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holds: dict[str, Counter[str]] = {}  # layer -> holder kind -> count
        self._deadline: dict[str, float] = {}  # layer -> the latest deadline of its holds

    def hold(self, layer: str, holder: str, bound_s: float) -> None:
        """``holder`` (e.g. "save", "pull") reads ``layer``'s buffer for at most ``bound_s``."""
        with self._cond:
            self._holds.setdefault(layer, Counter())[holder] += 1
            self._deadline[layer] = max(self._deadline.get(layer, 0.0), time.monotonic() + bound_s)

    def release(self, layer: str, holder: str) -> None:
        with self._cond:
            holds = self._holds.get(layer)
            if not holds or holds[holder] <= 0:
                raise ValueError(f"release of {layer!r} by {holder!r}: not held")
            holds[holder] -= 1
            if holds[holder] == 0:
                del holds[holder]
            if not holds:
                del self._holds[layer]
                self._deadline.pop(layer, None)
                self._cond.notify_all()

    def held(self, layer: str) -> dict[str, int]:
        with self._cond:
            return dict(self._holds.get(layer, {}))

    def wait_free(self, layer: str, *, waiter: str) -> float:
        """Block until nothing holds ``layer``; the seconds waited. ``ReuseTimeout`` once its holds
        are past their deadline (plus ``GRACE_S``)."""
        t0 = time.monotonic()
        logged = False
        with self._cond:
            while layer in self._holds:
                now = time.monotonic()
                left = self._deadline[layer] + GRACE_S - now
                if left <= 0:
                    raise ReuseTimeout(
                        f"{waiter} cannot take its shared KV buffer: its previous occupant {layer!r} is still "
                        f"held by {dict(self._holds[layer])} past their deadline ({now - t0:.1f} s "
                        "waited); refusing to overwrite KV that is being read"
                    )
                if not logged and now - t0 >= HELD_LOG_S:
                    log.info("kvoffload_shared_gate_held", waiter=waiter, layer=layer, holders=dict(self._holds[layer]))
                    logged = True
                self._cond.wait(left if logged else min(left, t0 + HELD_LOG_S - now))
        return time.monotonic() - t0


GATE = ReuseGate()
