"""The contracts' shape: package, one service per concern, units in names, streaming data path."""

from google.protobuf.descriptor import FieldDescriptor

from kvoffload_proto.v1 import MAX_CHUNK_BYTES, metastore_pb2, stats_pb2, transfer_pb2

MODULES = (metastore_pb2, transfer_pb2, stats_pb2)


def _methods(module, service):
    return {m.name for m in module.DESCRIPTOR.services_by_name[service].methods}


def test_package_and_services():
    assert {m.DESCRIPTOR.package for m in MODULES} == {"kvoffload.v1"}
    assert _methods(metastore_pb2, "MetaStore") == {
        "RegisterPool",
        "Heartbeat",
        "DeregisterPool",
        "Alloc",
        "Lookup",
        "Exists",
        "MarkWritten",
        "Remove",
        "Lease",
        "RenewLease",
        "ReleaseLease",
        "Stats",
    }
    assert _methods(transfer_pb2, "Transfer") == {"ExchangeLayout", "ReadReady", "PrefillDone", "Heartbeat"}
    assert _methods(transfer_pb2, "LayerSource") == {"ReadLayer"}
    assert _methods(stats_pb2, "Stats") == {"GetStats"}


def test_read_layer_streams_bounded_chunks():
    method = transfer_pb2.DESCRIPTOR.services_by_name["LayerSource"].methods_by_name["ReadLayer"]
    assert method.server_streaming and not method.client_streaming
    assert MAX_CHUNK_BYTES == 1 << 20


def test_read_status_values():
    assert transfer_pb2.READ_DONE == 1 and transfer_pb2.READ_FAILED == 2
    assert transfer_pb2.ReadResult().status == transfer_pb2.READ_STATUS_UNSPECIFIED


def test_durations_and_sizes_name_their_unit():
    time_words = ("ttl", "timeout", "interval", "deadline", "expires", "age", "uptime", "_ms")
    for module in MODULES:
        for message in module.DESCRIPTOR.message_types_by_name.values():
            for field in message.fields:
                if field.type == FieldDescriptor.TYPE_MESSAGE or field.type == FieldDescriptor.TYPE_STRING:
                    continue
                if any(w in field.name for w in time_words):
                    assert field.name.endswith("_ms"), f"{message.name}.{field.name} needs a unit"
