"""``MetaStoreClient`` lives in kvcore (``kvcore.metaclient``) so that host-pool backends can use it
without depending on this service; this module re-exports it for existing callers."""

from kvcore.metaclient import (  # noqa: F401
    Allocation,
    Location,
    MetaStoreClient,
    PoolRecord,
    RemoteLease,
    error_from_rpc,
)

__all__ = ["Allocation", "Location", "MetaStoreClient", "PoolRecord", "RemoteLease", "error_from_rpc"]
