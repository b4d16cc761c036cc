"""Generated stubs of package ``kvoffload.v1``: ``metastore_pb2[_grpc]`` (MetaStore),
``transfer_pb2[_grpc]`` (Transfer, LayerSource), ``stats_pb2[_grpc]`` (Stats).

``MAX_CHUNK_BYTES`` is the largest ``DataChunk.data`` a LayerSource sends (transfer.proto).
"""

MAX_CHUNK_BYTES = 1 << 20
