"""What the ``AscendStoreConnector``'s saves report at the end of a step (``wait_for_save``): each
request's save counted and logged, or its objects (incomplete, never visible) removed; and,
layerwise, how many layers were already in the pool when the last layer's attention ended."""

from __future__ import annotations

import structlog

from kvcore.pool.host_pool import HostPoolBackend, PoolError
from kvoffload_vllm.plan import Transfer
from kvoffload_vllm.stats import Counters

log = structlog.get_logger("vllm.kvoffload.store")


def report_save(
    t: Transfer, error: BaseException | None, counters: Counters, object_bytes: int, pool: HostPoolBackend
) -> None:
    """Count one save; a failed one's objects (incomplete, never visible) are removed from ``pool``."""
    if error is None:
        counters.add(blocks_saved=len(t.keys), bytes_saved=len(t.keys) * object_bytes)
        log.info("kvoffload_saved", request_id=t.request_id, group=t.group, blocks=len(t.keys))
        return
    counters.add(save_errors=len(t.keys))
    log.warning("kvoffload_save_failed", request_id=t.request_id, group=t.group, blocks=len(t.keys), error=str(error))
    try:
        pool.remove(list(t.keys))
    except PoolError as exc:
        log.warning("kvoffload_remove_failed", request_id=t.request_id, error=str(exc))


def report_step(handoffs: list[float], saved_at: dict, saves: list[Transfer], counters: Counters) -> None:
    """Layerwise: the step's layers handed to the saver (``handoffs``, perf_counter times in layer order)
    and when each was in the pool (``saved_at``): how many were before the last layer's attention ended."""
    if not handoffs:
        return
    during = sum(1 for at in saved_at.values() if at < handoffs[-1])
    counters.add(layers_saved_during_forward=during)
    log.info(
        "kvoffload_step_saved",
        layers=len(handoffs),
        layers_saved_during_forward=during,
        forward_s=round(handoffs[-1] - handoffs[0], 4),
        first_layer_saved_s=round(min(saved_at.values(), default=handoffs[0]) - handoffs[0], 4),
        request_ids=sorted({t.request_id for t in saves}),
    )
