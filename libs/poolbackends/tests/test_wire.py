"""poolbackends.wire: every error type the MetaStore sends comes back as the same type, key and
numbers through the status code and trailing metadata, and geometries and records survive the
proto round trip."""

import grpc
import pytest

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import ObjectNotFound, PoolError, PoolFullError
from poolbackends import wire
from poolbackends.errors import MetaStoreUnavailable, WorldSizeExceeded
from poolbackends.records import Location, PoolRecord


class _Failed(grpc.RpcError):
    def __init__(self, code, details, md):
        self._code, self._details, self._md = code, details, md

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._md


@pytest.mark.parametrize("cls", [c for c in wire.STATUS if c is not ValueError], ids=lambda c: c.__name__)
def test_every_error_survives_the_wire(cls):
    exc = (
        PoolFullError(key=b"k", needed=3, free=1, evictable=1, num_blocks=4)
        if cls is PoolFullError
        else cls("what went wrong", key=b"k")
    )
    back = wire.error_from_rpc(_Failed(wire.status_of(exc), wire.message_of(exc), wire.trailing_metadata(exc)), "X")
    assert type(back) is cls and back.key == b"k"
    if cls is PoolFullError:
        assert (back.needed, back.free, back.evictable) == (3, 1, 1)
    else:
        assert str(back) == "what went wrong (key b'k')"


def test_value_errors_travel_as_invalid_argument():
    exc = ValueError("keys[0] must be bytes")
    back = wire.error_from_rpc(_Failed(wire.status_of(exc), wire.message_of(exc), wire.trailing_metadata(exc)), "X")
    assert type(back) is ValueError and str(back) == "keys[0] must be bytes"


def test_geometry_and_records_round_trip():
    geo = PoolGeometry(block_size=4, plane_row_bytes=(8, 16), num_blocks=3, plane_labels=((0, "main"), (0, "indexer")))
    assert wire.geometry_from_pb(wire.geometry_to_pb(geo)) == geo
    rec = PoolRecord("p0", "seg", "host-a", geo)
    assert wire.pool_from_pb(wire.pool_to_pb(rec)) == rec
    loc = Location(b"k", "p0", 2, 96, (0, 1), True)
    assert wire.location_from_pb(wire.location_to_pb(loc)) == loc


def test_names_that_do_not_match_their_code_are_never_rebuilt():
    e = wire.error_from_rpc(
        _Failed(grpc.StatusCode.NOT_FOUND, "no object", ((wire.ERROR_MD, "ObjectNotFound"), (wire.KEY_MD, b"k1"))),
        "Lease",
    )
    assert type(e) is ObjectNotFound and e.key == b"k1" and str(e) == "no object"
    e = wire.error_from_rpc(
        _Failed(grpc.StatusCode.FAILED_PRECONDITION, "full", ((wire.ERROR_MD, "WorldSizeExceeded"),)), "R"
    )
    assert type(e) is WorldSizeExceeded
    # a name that does not match its status code, or names no known type, is never rebuilt
    for name, code in (("WorldSizeExceeded", grpc.StatusCode.NOT_FOUND), ("os.system", grpc.StatusCode.INTERNAL)):
        e = wire.error_from_rpc(_Failed(code, "x", ((wire.ERROR_MD, name),)), "Exists")
        assert type(e) is PoolError and code.name in str(e)
    md = tuple((wire.FULL_MD[n], str(v)) for n, v in (("needed", 3), ("free", 1), ("evictable", 1), ("num_blocks", 4)))
    e = wire.error_from_rpc(
        _Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, "pool 'p0': full", md + ((wire.KEY_MD, b"k"),)), "A"
    )
    assert isinstance(e, PoolFullError) and (e.needed, e.free, e.evictable, e.key) == (3, 1, 1, b"k")
    assert type(wire.error_from_rpc(_Failed(grpc.StatusCode.INVALID_ARGUMENT, "bad", ()), "A")) is ValueError
    e = wire.error_from_rpc(_Failed(grpc.StatusCode.DEADLINE_EXCEEDED, "slow", ()), "Exists")
    assert type(e) is MetaStoreUnavailable and e.code == grpc.StatusCode.DEADLINE_EXCEEDED
