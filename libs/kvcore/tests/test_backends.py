"""Backend availability: the embedded backend always runs; mooncake, memcache and memfabric need their
module (no NPU: the memcache and memfabric adapters decide about their data path at construction);
else say why, with what to install."""

from __future__ import annotations

import importlib
import pickle
from types import ModuleType
from typing import Any

import pytest

from kvcore import backends
from kvcore.backends import BackendUnavailableError, describe_availability, require_available
from kvcore.config.errors import ConfigError

STORE_ALTERNATIVE = "use backend 'kvoffload' (the embedded host pool managed by kvoffload-metastore)"
TRANSFER_ALTERNATIVE = "use transfer_backend 'kvoffload' (the embedded P→D data path"


def install(
    monkeypatch: pytest.MonkeyPatch, present: dict[str, Any], failing: dict[str, BaseException] | None = None
) -> None:
    """Imports succeed for ``present`` (name -> module), raise for ``failing``, are missing otherwise."""
    failing = failing or {}

    def fake_import(name: str) -> Any:
        if name in failing:
            raise failing[name]
        if name in present:
            return present[name]
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(backends, "import_module", fake_import)


ALL_PRESENT = {"memcache_hybrid": ModuleType("memcache_hybrid"), "memfabric_hybrid": ModuleType("memfabric_hybrid")}
MEMFABRIC_INSTALL = "install MemFabric: scripts/install-memcache (it runs `pip install memfabric_hybrid==1.3.0`)"


def unavailable(**kw: Any) -> str:
    with pytest.raises(BackendUnavailableError) as info:
        require_available(**kw)
    return str(info.value)


def test_embedded_backends_always_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, {})
    require_available(backend="kvoffload", transfer_backend="kvoffload")
    require_available()
    assert describe_availability()["kvoffload"] == "available"


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        (
            {"backend": "memcache"},
            [
                "backend 'memcache' cannot run here: memcache_hybrid cannot be imported",
                "ModuleNotFoundError: No module named 'memcache_hybrid'",
                "scripts/install-memcache",
                STORE_ALTERNATIVE,
            ],
        ),
        (
            {"transfer_backend": "memfabric"},
            [
                "transfer_backend 'memfabric' cannot run here: memfabric_hybrid cannot be imported",
                "No module named 'memfabric_hybrid'",
                MEMFABRIC_INSTALL,
                TRANSFER_ALTERNATIVE,
            ],
        ),
    ],
)
def test_module_missing(monkeypatch: pytest.MonkeyPatch, kw: dict[str, str], words: list[str]) -> None:
    install(monkeypatch, {})
    message = unavailable(**kw)
    for word in words:
        assert word in message, (word, message)


def test_module_present_means_available_for_every_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """No silent substitution either way: where memcache_hybrid and memfabric_hybrid import, both
    backends pass this check and their adapters (poolbackends.memcache, pdlink.memfabric) are what the
    services build; whether the data path runs is their construction's call, with the library's reason."""
    install(monkeypatch, ALL_PRESENT)
    require_available(backend="memcache", transfer_backend="memfabric")
    described = describe_availability()
    assert described["kvoffload"] == described["memcache"] == described["memfabric"] == "available"


@pytest.mark.parametrize(
    ("kw", "module"),
    [({"backend": "memcache"}, "memcache_hybrid"), ({"transfer_backend": "memfabric"}, "memfabric_hybrid")],
)
def test_an_ascend_backend_is_available_where_its_module_imports_without_an_npu(
    monkeypatch: pytest.MonkeyPatch, kw: dict[str, str], module: str
) -> None:
    """The adapter's construction decides about the data path (MemcacheUnavailable /
    MemfabricUnavailable at start-up), not this check: nothing but its own module is imported."""
    imported: list[str] = []
    install(monkeypatch, {module: ModuleType(module)})  # no torch_npu, no NPU
    probe = backends.import_module
    monkeypatch.setattr(backends, "import_module", lambda name: imported.append(name) or probe(name))
    require_available(**kw)
    assert imported == [module]
    assert describe_availability()[next(iter(kw.values()))] == "available"


def test_both_failures_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, {})
    with pytest.raises(BackendUnavailableError) as info:
        require_available(backend="memcache", transfer_backend="memfabric")
    assert len(info.value.reasons) == 2
    assert info.value.reasons[0].startswith("backend 'memcache'")
    assert info.value.reasons[1].startswith("transfer_backend 'memfabric'")
    assert str(info.value) == "; ".join(info.value.reasons)
    assert isinstance(info.value, RuntimeError)
    assert pickle.loads(pickle.dumps(info.value)).reasons == info.value.reasons


def test_each_backend_gets_its_own_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, {}, {"memfabric_hybrid": OSError("libmf_smem.so: cannot open shared object file")})
    with pytest.raises(BackendUnavailableError) as info:
        require_available(backend="memcache", transfer_backend="memfabric")
    memcache, memfabric = info.value.reasons
    assert "memcache_hybrid cannot be imported (ModuleNotFoundError" in memcache
    assert "scripts/install-memcache" in memcache
    assert memfabric == (
        "transfer_backend 'memfabric' cannot run here: memfabric_hybrid cannot be imported (OSError: "
        f"libmf_smem.so: cannot open shared object file); {MEMFABRIC_INSTALL}; use transfer_backend "
        "'kvoffload' (the embedded P→D data path: shared memory on one host, gRPC streaming across "
        "hosts)"
    )


def test_describe_availability_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, {"memfabric_hybrid": ModuleType("memfabric_hybrid")})
    described = describe_availability()
    assert described["kvoffload"] == described["memfabric"] == "available"
    assert described["memcache"].startswith("memcache_hybrid cannot be imported (ModuleNotFoundError")


@pytest.mark.parametrize(
    ("kw", "path"),
    [
        ({"backend": "memfabric"}, "backend"),
        ({"backend": "redis"}, "backend"),
        ({"transfer_backend": "memcache"}, "transfer_backend"),
    ],
)
def test_unknown_backend_name_is_a_config_error(kw: dict[str, str], path: str) -> None:
    with pytest.raises(ConfigError) as info:
        require_available(**kw)
    assert info.value.errors[0].startswith(f"{path}: got ")


def test_real_machine_reports_something_for_every_backend() -> None:
    described = describe_availability()
    assert described["kvoffload"] == "available"
    assert set(described) == {"kvoffload", "memcache", "mooncake", "memfabric"}
    assert all(isinstance(v, str) and v for v in described.values())


# ---- mooncake: runs where mooncake.store imports; no NPU needed ----------------------------------


def test_mooncake_runs_where_its_module_imports_without_an_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, {"mooncake.store": ModuleType("mooncake.store")})  # no torch_npu, no NPU
    require_available(backend="mooncake", transfer_backend="kvoffload")
    assert describe_availability()["mooncake"] == "available"


@pytest.mark.parametrize(
    "failure",
    [
        ModuleNotFoundError("No module named 'mooncake'", name="mooncake"),
        ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory"),
    ],
)
def test_mooncake_without_its_module_names_the_cause_and_the_install(
    monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    install(monkeypatch, {}, {"mooncake.store": failure})
    message = unavailable(backend="mooncake")
    assert message == (
        f"backend 'mooncake' cannot run here: mooncake.store cannot be imported "
        f"({type(failure).__name__}: {failure}); install Mooncake Store: scripts/install-mooncake (it "
        f"runs `apt-get install -y libibverbs1` and `pip install "
        f"mooncake-transfer-engine-non-cuda==0.3.13.post1`); {STORE_ALTERNATIVE}"
    )


def test_mooncake_on_this_machine_is_what_importing_it_says() -> None:
    """The real probe: available exactly when ``import mooncake.store`` works here (make test installs it)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        with pytest.raises(BackendUnavailableError, match="scripts/install-mooncake"):
            require_available(backend="mooncake")
        assert type(exc).__name__ in describe_availability()["mooncake"]
    else:
        require_available(backend="mooncake")
        assert describe_availability()["mooncake"] == "available"


@pytest.mark.parametrize(
    ("kw", "module"),
    [({"backend": "memcache"}, "memcache_hybrid"), ({"transfer_backend": "memfabric"}, "memfabric_hybrid")],
)
def test_ascend_backends_on_this_machine_are_what_importing_them_says(kw: dict[str, str], module: str) -> None:
    """The real probe: available exactly when the module imports here (make test installs both wheels)."""
    name = next(iter(kw.values()))
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - the probe must report whatever the import raised here
        with pytest.raises(BackendUnavailableError, match="scripts/install-memcache"):
            require_available(**kw)
        assert type(exc).__name__ in describe_availability()[name]
    else:
        require_available(**kw)
        assert describe_availability()[name] == "available"
