"""The decode's control port, ``kvoffload.v1.Transfer``: ``pdlink``'s servicer and pull state
machine over this decode rank's ``DecodeRows`` (``kvoffload_decode.pull``). Streamed pulls from a
prefill's LayerSource go over the process's TLS; with ``engine`` (transfer_backend "memfabric" or
"mooncake") every pull reads through that transfer engine instead."""

from __future__ import annotations

from kvcore.layout import KVLayout
from kvoffload_decode.pull import DecodeRows
from pdlink.engine_rows import EngineRows
from pdlink.pull_consumer import PullConsumer
from pdlink.sources import RowSources
from pdlink.transfer_service import TransferServicer
from svcruntime.tls import PROCESS, secure_or_insecure_channel

__all__ = ["decode_transfer"]


def decode_transfer(
    loop,
    layout: KVLayout,
    model_id: str,
    host_id: str,
    read_retries: int = 2,
    tls=PROCESS,
    engine: EngineRows | None = None,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> TransferServicer:
    """The Transfer servicer of one decode rank pulling into ``loop`` (a ``DecodeLoop`` or, on a TP
    follower, ``FollowerPulls``)."""
    sources = RowSources(lambda endpoint: secure_or_insecure_channel(endpoint, tls))
    consumer = PullConsumer(
        DecodeRows(loop, layout),
        sources,
        model_id=model_id,
        host_id=host_id,
        read_retries=read_retries,
        engine=engine,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    return TransferServicer(consumer)
