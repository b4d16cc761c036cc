"""``pdlink.engines`` over ``kvcore.transferregistry``: every entry's engine factory imports and makes
the transfer named after its entry; an engine starts through its entry alone (a new backend touches
its module and its entry), and what it raises when it cannot run here becomes ``EngineUnavailable``
with its own reason. No engine library is needed: the real engines are ``test_memfabric.py`` /
``test_mooncake.py``'s."""

from __future__ import annotations

import inspect
import textwrap
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcore.pool.registry import load
from kvcore.transferregistry import ENGINE_TRANSFERS, TRANSFERS, TransferBackend
from pdlink import engines, memfabric, mooncake_transfer
from pdlink.engine_rows import EngineCannotRun
from pdlink.engines import EngineUnavailable, register_segment, start_engine


@pytest.mark.parametrize("name", ENGINE_TRANSFERS)
def test_every_entrys_factory_imports_and_makes_the_transfer_named_after_it(name: str) -> None:
    factory = load(str(TRANSFERS[name].engine))
    assert list(inspect.signature(factory).parameters) == ["role", "host", "d2h"]
    made = typing.get_type_hints(factory)["return"]
    assert made.name == name  # the name the layout carries (LayoutMetadata.transfer_engine)
    assert {"register", "read", "close"} <= set(dir(made))


def test_the_embedded_backend_has_no_engine_and_the_error_lists_the_engines() -> None:
    with pytest.raises(
        ValueError, match="transfer_backend 'kvoffload' has no transfer engine; engines: memfabric, mooncake"
    ):
        start_engine("kvoffload", "Decode", "127.0.0.1", None)
    with pytest.raises(ValueError, match="transfer_backend 'nixl' has no transfer engine"):
        start_engine("nixl", "Decode", "127.0.0.1", None)


@pytest.fixture
def fake_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A backend 'fake' in a module of its own, known by its registry entry only."""
    (tmp_path / "fake_engine.py").write_text(
        textwrap.dedent(
            """
            from pdlink.engine_rows import EngineCannotRun

            class FakeCannotRun(ImportError, EngineCannotRun):
                pass

            class FakeTransfer:
                name = "fake"
                session = "h:1"
                def register(self, address, nbytes):
                    raise FakeCannotRun(f"cannot register {nbytes} bytes at {address:#x}")

            def start_transfer(role, host, d2h):
                if host == "nowhere":
                    raise FakeCannotRun("fake_lib cannot be imported; install it")
                if host == "":
                    raise ValueError("host must be the address peers reach this process at, got ''")
                return FakeTransfer()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = TransferBackend("fake", "a fake engine", None, None, engine="fake_engine:start_transfer")
    monkeypatch.setattr(engines, "TRANSFERS", {**TRANSFERS, "fake": entry})
    return SimpleNamespace(entry=entry)


def test_a_new_backend_starts_through_its_entry_alone(fake_backend: SimpleNamespace) -> None:
    transfer = start_engine("fake", "Prefill", "10.0.0.1", None)
    assert (transfer.name, transfer.session) == ("fake", "h:1")


@pytest.mark.parametrize(
    ("host", "reason"),
    [("nowhere", "fake_lib cannot be imported; install it"), ("", "host must be the address peers reach")],
)
def test_an_engine_that_cannot_start_is_unavailable_with_its_own_reason(
    fake_backend: SimpleNamespace, host: str, reason: str
) -> None:
    with pytest.raises(EngineUnavailable) as info:
        start_engine("fake", "Decode", host, None)
    assert str(info.value).startswith(f"transfer_backend 'fake': {reason}")


def test_a_refused_registration_is_unavailable_naming_the_backend(fake_backend: SimpleNamespace) -> None:
    transfer = start_engine("fake", "Prefill", "10.0.0.1", None)
    with pytest.raises(EngineUnavailable, match="^transfer_backend 'fake': cannot register 4096 bytes at 0x1000$"):
        register_segment(transfer, 0x1000, 4096)


def test_other_errors_of_an_engine_are_not_swallowed(fake_backend: SimpleNamespace, monkeypatch) -> None:
    monkeypatch.setattr("fake_engine.start_transfer", lambda role, host, d2h: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        start_engine("fake", "Prefill", "10.0.0.1", None)


def test_the_real_engines_cannot_run_errors_are_engine_cannot_run() -> None:
    for error in (
        memfabric.MemfabricNotInstalled,
        memfabric.MemfabricUnavailable,
        mooncake_transfer.MooncakeNotInstalled,
        mooncake_transfer.MooncakeUnavailable,
    ):
        assert issubclass(error, EngineCannotRun), error
    assert not issubclass(memfabric.MemfabricError, EngineCannotRun)  # a failed read is no start-up failure
    assert not issubclass(mooncake_transfer.MooncakeError, EngineCannotRun)


def test_memfabrics_factory_takes_its_keys_from_the_d2h_config(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr(memfabric.MemfabricTransfer, "start", lambda *a, **kw: calls.append((a, kw)))
    memfabric.start_transfer(
        "Decode", "10.0.0.2", SimpleNamespace(memfabric_device_id=3, memfabric_data_op="host_rdma")
    )
    memfabric.start_transfer("Prefill", "10.0.0.1", None)  # no D2H config: memfabric's defaults
    assert calls == [(("Decode", "10.0.0.2"), {"device_id": 3, "data_op": "host_rdma"}), (("Prefill", "10.0.0.1"), {})]


def test_mooncakes_factory_starts_the_same_engine_for_both_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(mooncake_transfer.MooncakeTransfer, "start", lambda host: calls.append(host))
    mooncake_transfer.start_transfer("Prefill", "10.0.0.1", None)
    mooncake_transfer.start_transfer("Decode", "10.0.0.2", SimpleNamespace())
    assert calls == ["10.0.0.1", "10.0.0.2"]
