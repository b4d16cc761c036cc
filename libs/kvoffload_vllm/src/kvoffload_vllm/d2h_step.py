"""What the D2H connector's scheduler hands its workers each step (``D2HStepMetadata``): the
producer's sends, the consumer's new receives (``Recv``) and its cancellations."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvoffload_vllm.d2h_plan import Send


@dataclass(frozen=True)
class Recv:
    """A decode request whose prompt KV comes from a prefill: vLLM request ``req_id``, known to the
    proxy and the prefill as ``transfer_id``; ``block_ids[g]`` its blocks of KV cache group g for the
    prompt's ``num_tokens`` tokens (vLLM's null block where a sliding window skips one), of which the
    first ``local_tokens`` tokens are this decode's own prefix-cache hit."""

    req_id: str
    transfer_id: str
    metaserver: str
    token: str | None
    num_tokens: int
    local_tokens: int
    block_ids: tuple[tuple[int, ...], ...]


@dataclass
class D2HStepMetadata(KVConnectorMetadata):
    """One scheduler step's work for the workers."""

    sends: list[Send] = field(default_factory=list)  # producer
    recvs: list[Recv] = field(default_factory=list)  # consumer: new requests to pull
    cancelled: list[str] = field(default_factory=list)  # consumer: requests finished while still loading
