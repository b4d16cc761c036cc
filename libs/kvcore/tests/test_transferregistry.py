"""The P→D transfer-backend registry: one entry per backend, whose names are the config's
``transfer_backend`` choices and the lists the stack, vLLM and the services read; whose probes decide
availability; whose keys are refused with another backend. Its engine factories are pdlink's, tested
there (``libs/pdlink/tests/test_engines.py``)."""

from __future__ import annotations

import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest
from config_support import decode_d2h, errors_of, with_extra

from kvcore import backends, transferregistry
from kvcore.backends import BackendUnavailableError, require_available
from kvcore.config.connectors import D2HConnectorConfig
from kvcore.config.errors import ConfigError
from kvcore.config.node import missing_transfer_backend
from kvcore.config.parse import parse_kv_transfer_config
from kvcore.pool.registry import EMBEDDED, MOONCAKE_INSTALL
from kvcore.transferregistry import (
    ENGINE_TRANSFERS,
    STACK_TRANSFERS,
    TRANSFER_NAMES,
    TRANSFERS,
    VLLM_TRANSFERS,
    TransferBackend,
    either,
    uses_engine,
)

LISTED = "'kvoffload', 'memfabric', 'mooncake'"


def test_the_derived_lists_are_the_entries_facts() -> None:
    assert TRANSFER_NAMES == ("kvoffload", "memfabric", "mooncake")
    assert all(name == b.name for name, b in TRANSFERS.items())
    assert STACK_TRANSFERS == ("kvoffload", "mooncake")  # memfabric needs an Ascend NPU
    assert VLLM_TRANSFERS == ("kvoffload", "mooncake") and ENGINE_TRANSFERS == ("memfabric", "mooncake")
    assert [uses_engine(n) for n in (*TRANSFER_NAMES, None, "nixl")] == [False, True, True, False, False]


def test_the_embedded_backend_runs_everywhere_and_has_no_engine() -> None:
    embedded = TRANSFERS[EMBEDDED]
    assert embedded.probe is None and embedded.engine is None and not embedded.needs and not embedded.keys
    assert embedded.one_host is not None and embedded.across_hosts is not None
    assert embedded.one_host.name != embedded.across_hosts.name  # shared memory here, the gRPC stream across
    assert not embedded.vllm_refusal and embedded.stack


def test_every_entry_says_where_it_runs_and_what_it_needs() -> None:
    """A backend runs on one host, across hosts or both; every one but the embedded needs a module
    (its probe names how to install it) and moves rows through an engine named as a hook."""
    for b in TRANSFERS.values():
        assert b.one_host is not None or b.across_hosts is not None, b.name
        assert b.summary, b.name
        if b.name != EMBEDDED:
            assert b.probe is not None and "install" in b.probe.install, b.name
            assert b.engine is not None and b.engine.count(":") == 1 and b.engine.startswith("pdlink."), b.name


def test_each_entrys_keys_are_fields_of_the_d2h_config_and_belong_to_one_backend() -> None:
    owned = [key for b in TRANSFERS.values() for key in b.keys]
    assert set(owned) <= set(D2HConnectorConfig.model_fields) and len(set(owned)) == len(owned)
    assert all(what for b in TRANSFERS.values() for what in b.keys.values())  # the refusal quotes it


@pytest.mark.parametrize("chosen", ["kvoffload", "mooncake"])
def test_a_key_of_another_backend_is_refused_naming_its_owner_and_the_chosen_one(chosen: str) -> None:
    problems = errors_of(parse_kv_transfer_config, with_extra(decode_d2h(chosen), memfabric_device_id=1))
    assert problems == [
        "kv_connector_extra_config.memfabric_device_id: applies to transfer_backend 'memfabric' only (the Ascend "
        f"NPU memfabric's TransferEngine binds; default 0), not {chosen!r}; remove it"
    ]


def test_an_unknown_backend_is_refused_listing_the_registrys_names() -> None:
    problems = errors_of(parse_kv_transfer_config, decode_d2h("nixl"))
    assert problems == [f"kv_connector_extra_config.transfer_backend: got 'nixl' (str); must be one of {LISTED}"]
    with pytest.raises(ConfigError) as info:
        require_available(transfer_backend="nixl")
    assert info.value.errors == [f"transfer_backend: got 'nixl' (str); must be one of {LISTED}"]


def test_a_missing_backend_names_every_choice() -> None:
    assert missing_transfer_backend("decode ").endswith(
        "transfer_backend: required for SfaRemoteD2HConnector; must be 'kvoffload', 'memfabric' or 'mooncake'"
    )
    assert (either(["a"]), either(["a", "b"]), either([])) == ("'a'", "'a' or 'b'", "none")


def test_availability_reads_the_transfer_entrys_probe_not_the_pool_entrys(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "mooncake" names a pool backend and a transfer backend: the transfer's probe is mooncake.engine."""
    present = {"mooncake.store": ModuleType("mooncake.store")}

    def fake_import(name: str) -> Any:
        if name in present:
            return present[name]
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(backends, "import_module", fake_import)
    require_available(backend="mooncake")
    with pytest.raises(BackendUnavailableError) as info:
        require_available(transfer_backend="mooncake")
    assert info.value.reasons == [
        "transfer_backend 'mooncake' cannot run here: mooncake.engine cannot be imported (ModuleNotFoundError: "
        f"No module named 'mooncake.engine'); {MOONCAKE_INSTALL}; use transfer_backend "
        "'kvoffload' (the embedded P→D data path: shared memory on one host, gRPC streaming across hosts)"
    ]


def test_a_new_entry_is_a_choice_of_availability_and_of_the_key_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new backend's entry alone changes, read at call time: the keys it owns are refused with
    the others, and the embedded one's summary words the alternative."""
    nixl = TransferBackend("nixl", "NIXL", None, None, engine="pdlink.nixl:start_transfer", keys={"nixl_x": "x"})
    monkeypatch.setattr(transferregistry, "TRANSFERS", {**TRANSFERS, "nixl": nixl})
    monkeypatch.setattr("kvcore.config.connectors.TRANSFERS", transferregistry.TRANSFERS)
    assert D2HConnectorConfig._raw_problems({"transfer_backend": "kvoffload", "nixl_x": 1}) == [
        (("nixl_x",), "applies to transfer_backend 'nixl' only (x), not 'kvoffload'; remove it")
    ]
    assert D2HConnectorConfig._raw_problems({"transfer_backend": "nixl", "nixl_x": 1}) == []


def test_reading_the_registry_imports_no_engine_no_pydantic_and_no_pdlink() -> None:
    """The command line reads the names (``--transfer`` choices) without paying for an engine or the config models."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, kvcore.transferregistry as r; r.STACK_TRANSFERS; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('pydantic', 'torch', 'pdlink', 'mooncake', 'memfabric_hybrid')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"
