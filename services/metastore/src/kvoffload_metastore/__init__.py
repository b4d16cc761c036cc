"""kvoffload-metastore: the MetaService role for the embedded host pool (pool registry, key ->
location, allocation, read leases, heartbeats, eviction). The gRPC server arrives with the
services issue; until then this package only reserves its place in the monorepo."""

__version__ = "0.1.0"
