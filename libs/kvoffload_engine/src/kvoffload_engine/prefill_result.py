"""What a layerwise prefill hands over: ``ComputedPrefill`` once every layer is computed, whose
``settle`` waits for its last saves and gives the ``PrefillResult`` (or raises ``PrefillError``).
``kvoffload_engine.prefill`` re-exports all three."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import structlog
import torch

from kvcore.pool.leases import Lease
from kvoffload_engine.prefill_blocks import PromptBlocks

log = structlog.get_logger(__name__)


@dataclass
class PrefillResult:
    """What a finished prefill hands over.

    ``lease`` keeps the prompt's pool objects (``keys``, one per block, in order) readable; the
    receiver copies what it needs and then calls ``LayerwisePrefill.release(result)``, which ends
    the lease and removes the request-scoped objects (the hash-keyed ones stay as prefix cache).
    """

    request_id: str
    logits: torch.Tensor  # [V] float32, last prompt position
    first_token: int
    draft_logits: torch.Tensor | None  # [V] MTP logits at the last position (predicts token P + 1)
    num_cached_tokens: int
    num_computed_tokens: int
    keys: list[bytes]
    lease: Lease
    owned_keys: list[bytes] = field(default_factory=list)


class PrefillError(RuntimeError):
    """A prefill failed; the request ends with this error and every slot it held is settled."""


@dataclass
class ComputedPrefill:
    """A prefill whose every layer is computed; its last saves may still run. ``settle`` (no engine
    lock: the next request computes meanwhile) waits for them and hands over the result, or raises
    the first save's error with the request's unwritten objects removed."""

    request_id: str
    blocks: PromptBlocks
    saved: Future  # done once every save of the request has run
    save_errors: list[BaseException]
    logits: torch.Tensor
    first_token: int
    draft_logits: torch.Tensor | None
    start: int  # tokens the prefix cache held

    def settle(self) -> PrefillResult:
        blocks, rid = self.blocks, self.request_id
        self.saved.result()
        try:
            if self.save_errors:
                raise PrefillError(
                    f"saving request {rid} to the host pool failed: {self.save_errors[0]!r}"
                ) from self.save_errors[0]
            lease = blocks.pool.lease(blocks.keys, blocks.lease_ttl_ms)  # before the chunks' leases end
        except BaseException:
            blocks.release_leases()
            blocks.remove_unwritten()  # complete hash blocks stay cached
            raise
        blocks.release_leases()
        n = blocks.num_tokens
        log.info(
            "prefill_done", request_id=rid, prompt_tokens=n, cached_tokens=self.start, computed_tokens=n - self.start
        )
        return PrefillResult(
            rid,
            self.logits,
            self.first_token,
            self.draft_logits,
            self.start,
            n - self.start,
            blocks.keys,
            lease,
            blocks.owned,
        )
