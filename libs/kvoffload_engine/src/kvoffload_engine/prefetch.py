"""Miss prefetch for sparse decode: while layer ℓ runs, load the rows layer ℓ+1 will likely miss.

**Prediction.** Layer ℓ's top-k of this step (adjacent layers' selections overlap: on the
recorded SmolLM2 trace it foresees about a fifth of the next layer's misses, the best of the
predictors ``kvoffload_bench.miss_predictors`` scores, and it costs nothing to know). Of those tokens, the ones
below the row's own position (the row at the current position of layer ℓ+1 is written only when
ℓ+1 runs; every earlier row is final in the host pool) and not resident in layer ℓ+1's hot buffer
(``HotCache.resident``, read-only) are the candidates; per request at most ``budget`` times as
many as the layer missed for it at the previous step (the first in top-k order: the layer below's
strongest selections), so a layer whose selections do not follow the layer below's costs little
extra traffic.

**Loading.** One background thread gathers the candidates from the host pool into a staging
buffer (native gather, GIL released; on an accelerator then one copy to the device) while the
main thread runs layer ℓ's attention and layer ℓ+1's projection and indexer. When layer ℓ+1
resolves its top-k against the hot cache, each miss found in the staging buffer is copied from
it into its hot slot (on an accelerator a device-local copy: its host-to-device transfer already
happened off the critical path); the other misses are gathered from the host pool as without
prefetch. The critical path waits at most ``wait_s`` for a prefetch (default 0: never): a load
not finished by then is dropped (counted as late) and every miss is gathered as usual.

**Correctness.** A prediction only decides which rows travel early: the staged bytes are the host
pool's bytes of final rows, so every hot slot holds the same bytes with or without prefetch and
the results are identical (I2; tested with prefetch on and off). The hot cache's residency never
sees the prediction. Steps with draft tokens (MTP) and the ``keep_device_kv_cache`` reference
run without prefetch.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvcore.hotcache.cache import HotCache
from kvcore.hotcache.gather import gather_rows, use_one_thread_here


@dataclass(frozen=True)
class Staged:
    """Rows loaded ahead for one layer: ``keys`` [P] sorted (batch row * stride + token) and
    their bytes ``rows`` [P, W] in the hot buffer's dtype, on its device."""

    keys: torch.Tensor
    rows: torch.Tensor
    stride: int

    def find(self, miss_rows: torch.Tensor, miss_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For misses (``miss_rows`` [M] batch rows, ``miss_tokens`` [M]): (found [M] bool, the
        staged row of each found miss [F])."""
        want = miss_rows.to(torch.int64) * self.stride + miss_tokens  # [M]
        at = torch.searchsorted(self.keys, want).clamp(max=max(self.keys.numel() - 1, 0))  # [M]
        found = self.keys[at] == want if self.keys.numel() else torch.zeros_like(want, dtype=torch.bool)
        return found, at[found]


class MissPrefetcher:
    """Loads predicted misses of the next layer on one background thread (module docstring)."""

    def __init__(self, hotcache: HotCache, *, native: bool = True, budget: float = 2.0) -> None:
        self.hotcache = hotcache
        self.native = native
        self.budget = budget
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="kv-prefetch", initializer=use_one_thread_here if native else None
        )
        self._pending: dict[int, tuple[Future, torch.Tensor, int]] = {}  # layer -> (rows future, keys, stride)
        self._misses: dict[int, dict[str, int]] = {}  # layer -> request -> misses at its last step
        self.wait_s = 0.0  # the longest a layer waits for its load before gathering without it
        self.late = 0  # loads dropped because they were not done in time

    def observe(self, layer: int, request_ids: list[str], miss_rows: torch.Tensor) -> None:
        """Record ``layer``'s misses per request at this step (``miss_rows`` [M] batch rows): the
        next step's budget."""
        counts = torch.bincount(miss_rows.to(torch.int64), minlength=len(request_ids)).tolist()
        self._misses[layer] = dict(zip(request_ids, counts, strict=True))

    def forget(self, request_id: str) -> None:
        for per in self._misses.values():
            per.pop(request_id, None)

    def start(
        self,
        layer: int,
        request_ids: list[str],
        plane: torch.Tensor,
        block_table: torch.Tensor,
        topk: torch.Tensor,
        positions: torch.Tensor,
        hot: torch.Tensor,
    ) -> int:
        """Begin loading ``layer``'s predicted misses: ``topk`` [R, k] of the layer below at this
        step, ``positions`` [R] each row's position, ``block_table`` [R, blocks] each row's pool
        blocks, ``plane`` the host-pool plane of ``layer``, ``hot`` [S, capacity, W] its hot
        buffer (dtype and device). Returns how many rows it loads."""
        self.cancel(layer)
        tokens = topk.to("cpu", torch.int64).contiguous()  # [R, k]
        final = (tokens >= 0) & (tokens < positions.to("cpu", torch.int64)[:, None])  # [R, k]
        want = final & ~self.hotcache.resident(layer, request_ids, tokens)  # [R, k]
        last = self._misses.get(layer, {})
        cap = torch.tensor([last.get(r, 0) for r in request_ids], dtype=torch.float64).mul_(self.budget).ceil_()
        want &= want.cumsum(1) <= cap[:, None]  # [R, k] the first candidates of each row, in top-k order
        rows, cols = want.nonzero(as_tuple=True)  # [P] each, row-major: keys come out sorted
        if rows.numel() == 0:
            return 0
        stride = int(positions.max()) + 1
        toks = tokens[rows, cols]  # [P]
        keys = rows * stride + toks  # [P], ascending (distinct tokens per row, rows ascending)
        keys, order = keys.sort()
        rows, toks = rows[order], toks[order]
        future = self._pool.submit(
            _load, plane, block_table, rows.to(torch.int32), toks, hot.dtype, hot.device, hot.shape[-1], self.native
        )
        self._pending[layer] = (future, keys, stride)
        return int(rows.numel())

    def take(self, layer: int) -> Staged | None:
        """The rows loaded for ``layer``; None when nothing was started or the load is not done
        within ``wait_s`` (it then counts as ``late``). A load that failed raises here."""
        entry = self._pending.pop(layer, None)
        if entry is None:
            return None
        future, keys, stride = entry
        try:
            rows = future.result(timeout=self.wait_s)
        except TimeoutError:
            self.late += 1
            return None
        return Staged(keys, rows, stride)

    def cancel(self, layer: int | None = None) -> None:
        """Drop what was started for ``layer`` (every layer when None), waiting for its load."""
        for i in [layer] if layer is not None else list(self._pending):
            entry = self._pending.pop(i, None)
            if entry is not None:
                entry[0].exception()  # wait; its result (or failure) is no longer wanted

    def close(self) -> None:
        self.cancel()
        self._pool.shutdown(wait=True)


def _load(
    plane: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    width: int,
    native: bool,
) -> torch.Tensor:
    """Gathers pool rows (batch ``rows`` [P] int32, ``tokens`` [P]) -> [P, width] of ``dtype`` on
    ``device`` (background thread)."""
    n = rows.numel()
    staging = torch.empty(
        (1, n, plane.shape[-1]), dtype=torch.uint8, pin_memory=device.type == "cuda"
    )  # [1, P, row_bytes]
    gather_rows(
        plane,
        block_table,
        rows,
        tokens,
        staging,
        torch.zeros(block_table.shape[0], dtype=torch.int32),
        torch.arange(n, dtype=torch.int32),
        native=native,
    )
    return staging[0].view(dtype).view(n, width).to(device)
