"""pdlink: the whole prefill -> decode transfer contract (``kvoffload.v1.Transfer`` and
``LayerSource``, proto/kvoffload/v1/transfer.proto), both ends, for every producer and consumer
(the reference services and the vLLM connectors), with nothing of any one of them.

The consumer's side:

- ``pull_consumer``: ``PullConsumer``, the one pull state machine (layout checks, ReadReady -> pull ->
  READ_DONE / READ_FAILED, retries, heartbeats, PrefillDone) over a ``RowSink``, where the rows go.
- ``transfer_service``: ``TransferServicer``, ``kvoffload.v1.Transfer`` over a ``PullConsumer``.
- ``sources``: ``RowSources``, the reads out of the producer's shared memory or its LayerSource stream.
- ``pullcounters``: ``PullCounters``, the counters every consumer exposes (``COUNTERS``).
- ``registration``: a decode's registration of a request at the proxy's ``/v1/metaserver`` (the
  message, its retries, the blocking client).

The producer's side:

- ``links``: ``DecodeLink`` to one decode control endpoint (layout exchange, ReadReady settling a
  ``ReadTicket``, heartbeats, PrefillDone).
- ``layer_source``: ``LayerSourceServicer``, ``kvoffload.v1.LayerSource`` over a ``RowBuffer``.
- ``chunks``: a LayerSource's rows as ``DataChunk`` messages of at most ``MAX_CHUNK_BYTES``.
- ``layout_messages``: the ``LayoutMetadata`` / ``LayerLayout`` a prefill hands every decode, built
  whole in one place.

Both:

- ``refusals``: the messages an end refuses outright, each with its gRPC status.
- ``engines``: the transfer engines a pull may run on (the ``kvcore.transferregistry`` entries'
  factories: transfer_backend "memfabric", "mooncake"): started, or stopped with the engine's own
  reason; ``engine_rows``: ``EngineRows``, the consumer's batched reads through one, and what every
  engine is (``Transfer``) and raises when it cannot run here (``EngineCannotRun``).
- ``memfabric``: memfabric_hybrid's TransferEngine; ``mooncake_transfer``: Mooncake Transfer Engine (TCP).
"""

__version__ = "0.1.0"
