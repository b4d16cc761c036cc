"""pdlink: the two ends of the prefill -> decode transfer contract (``kvoffload.v1.Transfer`` and
``LayerSource``, proto/kvoffload/v1/transfer.proto) that any producer or consumer can reuse, with
nothing of the kvoffload services themselves.

- ``links``: the producer's ``DecodeLink`` to one decode control endpoint (layout exchange,
  ReadReady settling a ``ReadTicket``, heartbeats, PrefillDone).
- ``chunks``: a LayerSource's rows as ``DataChunk`` messages of at most ``MAX_CHUNK_BYTES``.
- ``sources``: the consumer's ``RowSources``, announced rows out of the producer's shared memory
  or streamed from its LayerSource.
"""

__version__ = "0.1.0"
