"""Host copies of the running requests' KV blocks, for the layers that live in shared buffers.

With shared layer buffers (``kvoffload_vllm.shared_buffers``) a layer's blocks stay in its device
buffer only until the next layer of that buffer runs. Everything a later step attends over must
come back before the layer's attention: the blocks the request computed in earlier steps (earlier
chunks of its prompt, a partial block included) and its prefix hit. The host pool holds full prompt
blocks by content, best effort (it may be full, a block may be another engine's); this holds every
block of every running request, by request and position, as long as vLLM runs it: the store saves
each layer's new blocks here after its attention and reloads them before the layer's next
attention. ``drop`` frees a request's copy when vLLM finished it.

Bounded: the copies of one worker never hold more than ``budget_bytes`` (its share of the store's
``layerwise_request_kv_gb``, sent by the scheduler with each step). The scheduler admits a request
only when its worst case fits (``kvoffload_vllm.request_kv_budget``), so a reserve past the budget is
a bug, never an OOM: it allocates nothing and raises ``RequestKVFull`` naming the key. A request's
copy grows by doubling, never past the ``ceiling`` the scheduler admitted it with.

Thread use: the forward thread sizes (``reserve``) and drops, the saver thread writes (``put``),
the loader thread (``kvoffload_vllm.shared_loader``) reads (``get``) and writes the prefix hits; a
layer of a request is never written and read at once (its layer's reload waits for the layer's
previous save at the reuse gate); a ``put`` and a growing ``reserve`` exclude each other.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

BUDGET_KEY = "layerwise_request_kv_gb"  # the store's kv_connector_extra_config key that bounds the copies


class RequestKVFull(RuntimeError):
    """A reserve the budget cannot hold: nothing was allocated."""


class RequestKV:
    def __init__(
        self, layer_names: Sequence[str], block_bytes: int, *, pin: bool = False, budget_bytes: int | None = None
    ) -> None:
        self._layer = {name: i for i, name in enumerate(layer_names)}
        self.block_bytes, self._pin = block_bytes, pin
        self.budget_bytes = budget_bytes  # None: unbounded (no step has said the budget yet)
        self._lock = threading.Lock()
        self._reqs: dict[str, torch.Tensor] = {}  # request id -> [layers, capacity, block_bytes] uint8
        self._held = 0  # bytes of self._reqs

    def reserve(self, req_id: str, num_blocks: int, ceiling: int | None = None) -> None:
        """Room for positions ``[0, num_blocks)`` of every layer (grows by doubling up to ``ceiling``,
        keeps the data); ``RequestKVFull`` when even ``num_blocks`` would pass the budget."""
        row = len(self._layer) * self.block_bytes
        with self._lock:
            old = self._reqs.get(req_id)
            have = 0 if old is None else old.shape[1]
            if num_blocks <= have:
                return
            doubled = 2 * have if ceiling is None else min(2 * have, ceiling)
            room = None if self.budget_bytes is None else self.budget_bytes - self._held
            fits = [n for n in (max(num_blocks, doubled), num_blocks) if room is None or (n - have) * row <= room]
            if not fits:
                more = (num_blocks - have) * row
                raise RequestKVFull(
                    f"request {req_id!r}: {num_blocks} blocks of {len(self._layer)} layers ({more} bytes more) "
                    f"would pass the host copies' budget ({self._held} of {self.budget_bytes} bytes held; "
                    f"kv_connector_extra_config.{BUDGET_KEY}); nothing was allocated"
                )
            new = torch.empty((len(self._layer), fits[0], self.block_bytes), dtype=torch.uint8, pin_memory=self._pin)
            if old is not None:
                new[:, :have].copy_(old)
            self._reqs[req_id] = new
            self._held += (fits[0] - have) * row

    def _blocks(self, req_id: str, layer: str, positions: range) -> torch.Tensor:
        """Under ``self._lock`` (``put``) or not (``get``)."""
        kv = self._reqs.get(req_id)
        if kv is None or positions.stop > kv.shape[1]:
            have = 0 if kv is None else kv.shape[1]
            raise KeyError(f"request {req_id!r}: positions {positions} not reserved (holds {have} blocks)")
        return kv[self._layer[layer], positions.start : positions.stop]

    def put(self, req_id: str, layer: str, positions: range, blocks: torch.Tensor) -> None:
        """Blocks ``[n, block_bytes]`` (any device) of ``layer`` at ``positions`` (n of them). The copy is
        complete on return (a device buffer may be reused right after: never ``non_blocking``). Under
        the lock: a ``reserve`` that grows the copy (the next step's, while this step's saves still
        run) moves it whole, never between a put's lookup and its write."""
        with self._lock:
            self._blocks(req_id, layer, positions).copy_(blocks)

    def get(self, req_id: str, layer: str, positions: range) -> torch.Tensor:
        """``[n, block_bytes]`` of ``layer`` at ``positions`` (a view: copy before it is written again)."""
        with self._lock:
            return self._blocks(req_id, layer, positions)

    def drop(self, req_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in req_ids:
                gone = self._reqs.pop(rid, None)
                self._held -= 0 if gone is None else gone.numel()

    def nbytes(self) -> int:
        with self._lock:
            return self._held

    def __contains__(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._reqs
