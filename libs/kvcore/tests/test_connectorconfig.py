"""The keys of one connector's extra config: the store's pool keys and backend "mooncake"'s keys
(required with it, refused with the others), the D2H connector's vLLM-only keys and transfer_backend
"memfabric"'s keys."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from config_support import EXTRA, decode_d2h, errors_of, prefill_multi, prefill_only, with_extra

from kvcore.config.errors import ConfigError
from kvcore.config.parse import parse_kv_transfer_config


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            {"metastore": "nohostport"},
            "kv_connector_extra_config.metastore: got 'nohostport' (str); must be \"HOST:PORT\"",
        ),
        ({"metastore": "h:70000"}, "kv_connector_extra_config.metastore: got 'h:70000'"),
        ({"host_pool_gb": 0}, "kv_connector_extra_config.host_pool_gb: got 0 (int); must be a number of GiB > 0"),
        ({"host_pool_gb": "1GB"}, "kv_connector_extra_config.host_pool_gb: got '1GB' (str)"),
    ],
)
def test_store_pool_keys_are_checked(extra, message):
    with pytest.raises(ConfigError) as e:
        parse_kv_transfer_config(
            {
                "kv_connector": "AscendStoreConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"backend": "kvoffload", **extra},
            }
        )
    assert message in str(e.value)


def test_the_vllm_d2h_keys_are_typed_and_named_for_the_services_that_take_flags_instead():
    cfg = parse_kv_transfer_config(
        {
            "kv_connector": "SfaRemoteD2HConnector",
            "kv_role": "kv_consumer",
            "kv_port": 20050,
            "kv_connector_extra_config": {
                "advertise_host": "10.0.0.7",
                "data_port": 0,
                "peer_timeout_s": 3,
                "kv_digests": True,
            },
        },
        strict=True,
    )
    extra = cfg.kv_connector_extra_config
    assert (extra.advertise_host, extra.data_port, extra.peer_timeout_s, extra.kv_digests) == ("10.0.0.7", 0, 3.0, True)
    assert extra.vllm_only_problems() == [
        "kv_connector_extra_config.advertise_host: read by the vLLM connector only; the kvoffload services take "
        "--advertise-host instead",
        "kv_connector_extra_config.data_port: read by the vLLM connector only; the kvoffload services take "
        "--data-port instead",
        "kv_connector_extra_config.peer_timeout_s: read by the vLLM connector only; the kvoffload services take "
        "--peer-timeout-s instead",
        "kv_connector_extra_config.kv_digests: read by the vLLM connector only; the kvoffload services have no "
        "such option; remove it",
    ]
    for key, bad, rule in (
        ("advertise_host", "0.0.0.0", "not a wildcard"),
        ("advertise_host", "h:80", "without a port"),
        ("data_port", 70000, "in 0..65535"),
        ("peer_timeout_s", 0, "seconds > 0"),
    ):
        with pytest.raises(ConfigError, match=f"kv_connector_extra_config.{key}: got .*{rule}"):
            parse_kv_transfer_config(
                {
                    "kv_connector": "SfaRemoteD2HConnector",
                    "kv_role": "kv_consumer",
                    "kv_connector_extra_config": {key: bad},
                },
                strict=True,
            )


# ------------------------------------------------------------------------------------------------
# backend "mooncake": its keys, required with it and refused with the others

MOONCAKE = "127.0.0.1:50051"


def store_extra(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_producer", "kv_connector_extra_config": extra}


@pytest.mark.parametrize("inside_multi", [False, True], ids=["alone", "multi"])
def test_mooncake_backend_with_its_master(inside_multi: bool) -> None:
    base = prefill_multi(backend="mooncake", transfer_backend="kvoffload") if inside_multi else prefill_only("mooncake")
    raw = copy.deepcopy(base)
    extra = (raw["kv_connector_extra_config"]["connectors"][1] if inside_multi else raw)["kv_connector_extra_config"]
    extra.update(mooncake_master=MOONCAKE, host_pool_gb=0.5)
    store = parse_kv_transfer_config(json.dumps(raw), strict=True).store
    assert store is not None and store.backend == "mooncake"
    assert store.mooncake_master == MOONCAKE
    assert (store.mooncake_namespace, store.mooncake_lease_ttl_ms) == ("kvoffload", 5000)
    assert store.host_pool_gb == 0.5 and store.metastore is None
    extra.update(mooncake_namespace="team-a", mooncake_lease_ttl_ms=30_000)
    store = parse_kv_transfer_config(raw).store
    assert (store.mooncake_namespace, store.mooncake_lease_ttl_ms) == ("team-a", 30_000)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"backend": "mooncake"},
            [
                "kv_connector_extra_config.mooncake_master: required with backend 'mooncake'; "
                'must be "HOST:PORT" (the mooncake_master\'s RPC address, e.g. "127.0.0.1:50051")'
            ],
        ),
        (
            {"backend": "mooncake", "mooncake_master": None},
            ["kv_connector_extra_config.mooncake_master: required with"],
        ),
        (
            {"backend": "mooncake", "mooncake_master": MOONCAKE, "metastore": "127.0.0.1:5000"},
            [
                "kv_connector_extra_config.metastore: applies to backend 'kvoffload' only (the kvoffload-metastore "
                "that indexes the embedded pool; the mooncake backend keeps its index in the mooncake_master), "
                "not 'mooncake'; remove it"
            ],
        ),
        (
            {"backend": "kvoffload", "mooncake_master": MOONCAKE},
            [
                "kv_connector_extra_config.mooncake_master: applies to backend 'mooncake' only (the mooncake backend's "
                "master), not 'kvoffload'; remove it"
            ],
        ),
        (
            {"backend": "memcache", "mooncake_namespace": "a"},
            [
                "kv_connector_extra_config.mooncake_namespace: applies to backend 'mooncake' only "
                "(the mooncake backend's key namespace), not 'memcache'; remove it"
            ],
        ),
        (
            {"backend": "kvoffload", "mooncake_lease_ttl_ms": 5000},
            ["kv_connector_extra_config.mooncake_lease_ttl_ms: applies to backend 'mooncake' only"],
        ),
        (
            {"backend": "mooncake", "mooncake_master": "50051"},
            [
                "kv_connector_extra_config.mooncake_master: got '50051' (str); "
                'must be "HOST:PORT" (the mooncake_master\'s RPC address)'
            ],
        ),
        (
            {"backend": "mooncake", "mooncake_master": "h:0"},
            ["kv_connector_extra_config.mooncake_master: got 'h:0' (str)"],
        ),
        (
            {"backend": "mooncake", "mooncake_master": MOONCAKE, "mooncake_namespace": "a/b"},
            [
                "kv_connector_extra_config.mooncake_namespace: got 'a/b' (str); "
                "must be a non-empty string without '/' or surrounding spaces"
            ],
        ),
        (
            {"backend": "mooncake", "mooncake_master": MOONCAKE, "mooncake_namespace": ""},
            ["kv_connector_extra_config.mooncake_namespace: got '' (str)"],
        ),
        (
            {"backend": "mooncake", "mooncake_master": MOONCAKE, "mooncake_lease_ttl_ms": 0},
            ["kv_connector_extra_config.mooncake_lease_ttl_ms: got 0 (int); must be an int >= 1"],
        ),
        (
            {"backend": "mooncake", "mooncake_master": MOONCAKE, "mooncake_lease_ttl_ms": "5s"},
            ["kv_connector_extra_config.mooncake_lease_ttl_ms: got '5s' (str); must be an int >= 1"],
        ),
        (
            {"backend": "mooncake", "metastore": "127.0.0.1:5000", "mooncake_lease_ttl_ms": 0},  # every problem at once
            [
                "kv_connector_extra_config.mooncake_lease_ttl_ms: got 0",
                "kv_connector_extra_config.mooncake_master: required",
                "kv_connector_extra_config.metastore: applies to backend 'kvoffload' only",
            ],
        ),
    ],
)
def test_mooncake_rules(extra: dict[str, Any], expected: list[str]) -> None:
    errors = errors_of(parse_kv_transfer_config, store_extra(**extra))
    assert len(errors) == len(expected), errors
    for want in expected:
        assert any(e.startswith(want) for e in errors), (want, errors)


def test_mooncake_rules_name_the_field_inside_a_multi_connector() -> None:
    raw = prefill_multi(backend="mooncake", transfer_backend="kvoffload")
    raw["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]["metastore"] = "127.0.0.1:5000"
    errors = errors_of(parse_kv_transfer_config, raw)
    prefix = "kv_connector_extra_config.connectors[1].kv_connector_extra_config."
    assert [e.split(":")[0] for e in errors] == [f"{prefix}mooncake_master", f"{prefix}metastore"], errors


def test_the_other_backends_are_unchanged_by_the_mooncake_keys() -> None:
    """A memcache config may still carry metastore (as before); kvoffload's keys keep their meaning."""
    assert parse_kv_transfer_config(store_extra(backend="memcache", metastore="h:1")).store.metastore == "h:1"
    store = parse_kv_transfer_config(store_extra(backend="kvoffload", metastore="h:1", host_pool_gb=2)).store
    assert (store.metastore, store.host_pool_gb, store.mooncake_master) == ("h:1", 2.0, None)


# ---- transfer_backend "memfabric": its TransferEngine's device and data operation ----------------


def test_memfabric_keys_default_and_set() -> None:
    plain = parse_kv_transfer_config(decode_d2h("memfabric")).kv_connector_extra_config
    assert (plain.memfabric_device_id, plain.memfabric_data_op) == (0, "sdma")
    config = parse_kv_transfer_config(
        with_extra(decode_d2h("memfabric"), memfabric_device_id=3, memfabric_data_op="host_rdma")
    )
    extra = config.kv_connector_extra_config
    assert (extra.memfabric_device_id, extra.memfabric_data_op) == (3, "host_rdma")
    assert config.warnings == []


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (
            {"memfabric_device_id": 1},
            f"{EXTRA}.memfabric_device_id: applies to transfer_backend 'memfabric' only (the Ascend NPU memfabric's "
            "TransferEngine binds; default 0), not 'kvoffload'; remove it",
        ),
        (
            {"memfabric_data_op": "sdma"},
            f"{EXTRA}.memfabric_data_op: applies to transfer_backend 'memfabric' only "
            "(memfabric's data operation; default 'sdma'), not 'kvoffload'; remove it",
        ),
    ],
)
def test_memfabric_keys_are_refused_with_the_embedded_transfer_backend(extra: dict[str, Any], expected: str) -> None:
    assert errors_of(parse_kv_transfer_config, with_extra(decode_d2h("kvoffload"), **extra)) == [expected]


def test_memfabric_keys_inside_a_multi_connector_name_the_field() -> None:
    raw = prefill_multi("kvoffload", "kvoffload")
    raw["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]["memfabric_device_id"] = 0
    assert errors_of(parse_kv_transfer_config, raw)[0].startswith(
        f"{EXTRA}.connectors[0].{EXTRA}.memfabric_device_id: applies to transfer_backend 'memfabric' only"
    )


@pytest.mark.parametrize(
    ("extra", "path", "words"),
    [
        ({"memfabric_device_id": -1}, "memfabric_device_id", ["got -1 (int); must be an int >= 0"]),
        ({"memfabric_device_id": True}, "memfabric_device_id", ["got True (bool)"]),
        ({"memfabric_device_id": "0"}, "memfabric_device_id", ["got '0' (str)"]),
        (
            {"memfabric_data_op": "rdma"},
            "memfabric_data_op",
            ["'rdma' (str)", "'sdma', 'host_rdma', 'device_rdma'", "did you mean"],
        ),
        ({"memfabric_data_op": "host-rdma"}, "memfabric_data_op", ["'host-rdma' (str)", "did you mean 'host_rdma'?"]),
    ],
)
def test_memfabric_key_values(extra: dict[str, Any], path: str, words: list[str]) -> None:
    errors = errors_of(parse_kv_transfer_config, with_extra(decode_d2h("memfabric"), **extra))
    assert len(errors) == 1 and errors[0].startswith(f"{EXTRA}.{path}: "), errors
    for word in words:
        assert word in errors[0], (word, errors)
