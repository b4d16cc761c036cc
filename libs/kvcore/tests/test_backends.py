"""Backend availability: the embedded backend always runs; mooncake and memcache need their module (no NPU:
memcache's adapter decides about its data path at construction); memfabric needs module + NPU + an adapter;
else say why."""

from __future__ import annotations

import pickle
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from kvcore import backends
from kvcore.backends import BackendUnavailableError, describe_availability, require_available
from kvcore.config import ConfigError

STORE_ALTERNATIVE = "use backend 'kvoffload' (the embedded host pool managed by kvoffload-metastore)"
TRANSFER_ALTERNATIVE = "use transfer_backend 'kvoffload' (the embedded P→D data path"


def fake_torch(available: bool = True, count: int = 1) -> Any:
    return SimpleNamespace(npu=SimpleNamespace(is_available=lambda: available, device_count=lambda: count))


def install(monkeypatch: pytest.MonkeyPatch, present: dict[str, Any], failing: dict[str, BaseException] | None = None) -> None:
    """Imports succeed for ``present`` (name -> module), raise for ``failing``, are missing otherwise."""
    failing = failing or {}

    def fake_import(name: str) -> Any:
        if name in failing:
            raise failing[name]
        if name in present:
            return present[name]
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(backends, "import_module", fake_import)


ALL_PRESENT = {"memcache_hybrid": ModuleType("memcache_hybrid"), "memfabric_hybrid": ModuleType("memfabric_hybrid"),
               "torch_npu": ModuleType("torch_npu"), "torch": fake_torch()}


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
        ({"backend": "memcache"}, ["backend 'memcache' cannot run here: memcache_hybrid cannot be imported",
                                   "ModuleNotFoundError: No module named 'memcache_hybrid'",
                                   "scripts/install-memcache", STORE_ALTERNATIVE]),
        ({"transfer_backend": "memfabric"}, ["transfer_backend 'memfabric' cannot run here: memfabric_hybrid cannot be "
                                             "imported", "No module named 'memfabric_hybrid'", TRANSFER_ALTERNATIVE]),
    ],
)
def test_module_missing(monkeypatch: pytest.MonkeyPatch, kw: dict[str, str], words: list[str]) -> None:
    install(monkeypatch, {"torch_npu": ALL_PRESENT["torch_npu"], "torch": fake_torch()})
    message = unavailable(**kw)
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize(
    ("present", "failing", "reason"),
    [
        ({}, {}, "(torch_npu not installed (ModuleNotFoundError: No module named 'torch_npu'))"),
        ({}, {"torch_npu": OSError("libascendcl.so: cannot open shared object file")},
         "(torch_npu fails to import (OSError: libascendcl.so: cannot open shared object file))"),
        ({"torch_npu": ModuleType("torch_npu"), "torch": fake_torch(available=False)}, {},
         "torch.npu.is_available() is False (no Ascend NPU or driver)"),
        ({"torch_npu": ModuleType("torch_npu"), "torch": fake_torch(count=0)}, {}, "torch.npu.device_count() is 0"),
        ({"torch_npu": ModuleType("torch_npu"), "torch": SimpleNamespace()}, {}, "the torch_npu device query failed"),
    ],
)
@pytest.mark.parametrize(("kw", "module", "alternative"), [
    ({"transfer_backend": "memfabric"}, "memfabric_hybrid", TRANSFER_ALTERNATIVE),
])
def test_module_present_but_no_npu(
    monkeypatch: pytest.MonkeyPatch, present: dict[str, Any], failing: dict[str, BaseException], reason: str,
    kw: dict[str, str], module: str, alternative: str,
) -> None:
    install(monkeypatch, {module: ModuleType(module), **present}, failing)
    message = unavailable(**kw)
    name = next(iter(kw.values()))
    assert f"'{name}' cannot run here: {module} imports but no Ascend NPU is available" in message
    assert reason in message and alternative in message


def test_brief_example_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backends, "import_module", lambda name: ModuleType(name))
    monkeypatch.setattr(backends, "npu_problem", lambda: "torch_npu not installed")
    assert unavailable(transfer_backend="memfabric") == (
        "transfer_backend 'memfabric' cannot run here: memfabric_hybrid imports but no Ascend NPU is available "
        "(torch_npu not installed); use transfer_backend 'kvoffload' (the embedded P→D data path: shared memory on "
        "one host, gRPC streaming across hosts)"
    )


def test_module_and_npu_present_still_refuse_memfabric_without_an_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    """No silent substitution: where memfabric_hybrid and an NPU are there, the services would still
    run the embedded data path, so "memfabric" is refused, saying so; "memcache" has its adapter."""
    install(monkeypatch, ALL_PRESENT)
    with pytest.raises(BackendUnavailableError) as info:
        require_available(backend="memcache", transfer_backend="memfabric")
    assert [r.split(" cannot")[0] for r in info.value.reasons] == ["transfer_backend 'memfabric'"]
    assert "no memfabric adapter yet" in info.value.reasons[0]
    described = describe_availability()
    assert described["kvoffload"] == described["memcache"] == "available"


def test_memcache_is_available_where_its_module_imports_without_an_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter's construction decides about the data path (MemcacheUnavailable at start-up), not
    this check: no NPU probe for memcache."""
    install(monkeypatch, {"memcache_hybrid": ModuleType("memcache_hybrid")})  # no torch_npu, no NPU
    monkeypatch.setattr(backends, "npu_problem", lambda: pytest.fail("memcache must not probe the NPU"))
    require_available(backend="memcache", transfer_backend="kvoffload")
    assert describe_availability()["memcache"] == "available"


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
    install(monkeypatch, {k: v for k, v in ALL_PRESENT.items() if k != "memcache_hybrid"})
    with pytest.raises(BackendUnavailableError) as info:
        require_available(backend="memcache", transfer_backend="memfabric")
    memcache, memfabric = info.value.reasons
    assert "memcache_hybrid cannot be imported" in memcache and "no memfabric adapter yet" in memfabric


def test_describe_availability_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, {"memfabric_hybrid": ModuleType("memfabric_hybrid")})
    described = describe_availability()
    assert described["kvoffload"] == "available"
    assert described["memcache"].startswith("memcache_hybrid cannot be imported (ModuleNotFoundError")
    assert described["memfabric"].startswith("memfabric_hybrid imports but no Ascend NPU is available (torch_npu")


@pytest.mark.parametrize(("kw", "path"), [({"backend": "memfabric"}, "backend"), ({"backend": "redis"}, "backend"),
                                          ({"transfer_backend": "memcache"}, "transfer_backend")])
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


@pytest.mark.parametrize("failure", [
    ModuleNotFoundError("No module named 'mooncake'", name="mooncake"),
    ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory"),
])
def test_mooncake_without_its_module_names_the_cause_and_the_install(monkeypatch: pytest.MonkeyPatch,
                                                                      failure: BaseException) -> None:
    install(monkeypatch, {}, {"mooncake.store": failure})
    message = unavailable(backend="mooncake")
    assert message == (f"backend 'mooncake' cannot run here: mooncake.store cannot be imported "
                       f"({type(failure).__name__}: {failure}); install Mooncake Store: scripts/install-mooncake (it "
                       f"runs `apt-get install -y libibverbs1` and `pip install "
                       f"mooncake-transfer-engine-non-cuda==0.3.13.post1`); {STORE_ALTERNATIVE}")


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


def test_memcache_on_this_machine_is_what_importing_it_says() -> None:
    """The real probe: available exactly when ``import memcache_hybrid`` works here (make test installs it)."""
    try:
        import memcache_hybrid  # noqa: F401
    except Exception as exc:
        with pytest.raises(BackendUnavailableError, match="scripts/install-memcache"):
            require_available(backend="memcache")
        assert type(exc).__name__ in describe_availability()["memcache"]
    else:
        require_available(backend="memcache")
        assert describe_availability()["memcache"] == "available"
