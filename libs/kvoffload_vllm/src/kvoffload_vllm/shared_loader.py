"""The loader of one step on shared layer buffers: each layer's reloads run on a thread of their own,
up to ``layerwise_prefetch_layers`` (p) layers ahead of the forward.

The forward thread calls ``wait(layer)`` ahead of the layer's KV cache write (``SharedSteps``); the
loader prepares the layers in forward order (the reuse gate, the prefix hits, the earlier chunks:
``prepare``), so while layer L computes, layers L+1 … L+p are loaded. A layer k is started only when

- k ≤ r + p, with r the furthest layer the forward has reached (never more than p layers ahead), and
- its buffer's previous occupant, where that is an earlier layer of this forward, is behind the
  forward (its attention ran and every connector's ``save_kv_layer`` took its holds at the reuse
  gate), so the gate's ``wait_free`` in ``prepare`` sees every reader of the buffer (invariant I4:
  never overwrite KV that is being computed, read or saved). A previous occupant of the previous
  forward (a slot's first layer) took its holds before this step began.

One buffer (``layerwise_num_shared_buffers`` 1) loads nothing ahead: each layer's previous occupant
is the layer before it. An exception out of ``prepare`` (a gate past its bound, a bug; a load that
fails a request is reported by ``prepare`` itself) stops the loader and is raised to the forward by
the ``wait`` of that layer or any later one: never silent.

On a GPU the loader's copies go to the forward thread's stream (``stream``), in the order the gate
gives, so the device sees them as it saw the synchronous ones.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


class LayerLoader:
    def __init__(
        self,
        layers: Sequence[str],
        previous: dict[str, str],
        depth: int,
        prepare: Callable[[str], None],
        stream: Any = None,
    ) -> None:
        """``layers`` in forward order; ``previous``: a shared layer -> its buffer's previous occupant;
        ``depth``: p (≥ 1); ``stream``: the forward thread's CUDA stream, None on a CPU."""
        if depth < 1:
            raise ValueError(f"layerwise_prefetch_layers: expected >= 1, got {depth}")
        self.layers, self.depth, self._prepare, self._stream = list(layers), depth, prepare, stream
        self.index = {name: i for i, name in enumerate(self.layers)}
        # the index of each layer's previous occupant when it comes earlier in the forward, else -1
        self._after = [self._earlier(i, previous.get(name)) for i, name in enumerate(self.layers)]
        self._cond = threading.Condition()
        self._reached = -1  # the furthest layer the forward waited for
        self._done = 0  # layers [0, done) are prepared
        self._error: BaseException | None = None
        self._cancelled = False
        self.started: list[str] = []  # the layers prepare began, in order (a diagnostic and the tests')
        self._thread = threading.Thread(target=self._run, name="kvoffload-reload", daemon=True)

    def _earlier(self, i: int, occupant: str | None) -> int:
        at = -1 if occupant is None else self.index.get(occupant, -1)
        return at if at < i else -1

    def start(self) -> LayerLoader:
        self._thread.start()
        return self

    def _may_start(self, k: int) -> bool:
        return k <= self._reached + self.depth and (self._after[k] < 0 or self._after[k] < self._reached)

    def _run(self) -> None:
        cuda = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        try:
            with cuda, torch.inference_mode():  # the forward's host copies and buffers are inference tensors
                for k, layer in enumerate(self.layers):
                    with self._cond:
                        while not self._cancelled and not self._may_start(k):
                            self._cond.wait()
                        if self._cancelled:
                            return
                        self.started.append(layer)
                    self._prepare(layer)
                    with self._cond:
                        self._done = k + 1
                        self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - raised to the forward by wait()
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def wait(self, layer: str) -> None:
        """Until ``layer`` is prepared (the forward reached it: the loader may go p layers beyond); the
        loader's exception, if it stopped before ``layer``."""
        k = self.index[layer]
        with self._cond:
            if k > self._reached:
                self._reached = k
                self._cond.notify_all()
            while self._done <= k and self._error is None:
                self._cond.wait()
            if self._done <= k:
                assert self._error is not None
                raise self._error

    def close(self) -> None:
        """Stop before the next layer (a step that ended early) and join: nothing of this step is
        written after ``close``."""
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
