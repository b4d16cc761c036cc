"""Availability checks of the host-pool and P→D transfer backends named in user configs.

``"kvoffload"`` (the embedded host pool / embedded P→D data path) runs everywhere.
``"mooncake"`` (the host pool over Mooncake Store, ``poolbackends.mooncake``) runs wherever its
Python module ``mooncake.store`` imports (wheel ``mooncake-transfer-engine-non-cuda`` plus
Debian's ``libibverbs1``; no NPU needed); the mooncake_master it talks to is checked when the
pool connects. ``"memcache"`` (the host pool over Memcache, ``poolbackends.memcache``) and
``"memfabric"`` (the P→D layer pull over memfabric_hybrid's TransferEngine, ``pdlink.memfabric``)
are available wherever ``memcache_hybrid`` / ``memfabric_hybrid`` import: whether their data path
runs here (it needs an Ascend NPU driver) is decided by the adapter's own construction, the single
source of truth, which fails with the library's reason at start-up. Services call
``require_available`` at start-up: a backend that cannot run here is an error that says exactly
why (missing module and how to install it) and names the embedded alternative, never a silent
substitution. The import probe (``import_module``) is module-level so tests can replace it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvcore.configerrors import ConfigError, describe_value
from kvcore.confignames import STORE_BACKENDS, TRANSFER_BACKENDS

EMBEDDED = "kvoffload"
AVAILABLE = "available"

# backend name -> Python module it needs (the embedded backend needs none)
ASCEND_MODULES = {"memcache": "memcache_hybrid", "memfabric": "memfabric_hybrid"}
MEMCACHE_INSTALL = "install Memcache: scripts/install-memcache (it runs `pip install memcache_hybrid==1.3.0`)"
MEMFABRIC_INSTALL = "install MemFabric: scripts/install-memcache (it runs `pip install memfabric_hybrid==1.3.0`)"
_INSTALL = {"memcache": MEMCACHE_INSTALL, "memfabric": MEMFABRIC_INSTALL}
MOONCAKE_MODULE = "mooncake.store"
MOONCAKE_INSTALL = ("install Mooncake Store: scripts/install-mooncake (it runs `apt-get install -y libibverbs1` and "
                    "`pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`)")

_ALTERNATIVES = {
    "backend": "use backend 'kvoffload' (the embedded host pool managed by kvoffload-metastore)",
    "transfer_backend": (
        "use transfer_backend 'kvoffload' (the embedded P→D data path: shared memory on one host, "
        "gRPC streaming across hosts)"
    ),
}


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run on this machine; ``reasons`` holds one message per backend."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = list(reasons)
        super().__init__("; ".join(self.reasons))

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.reasons,))


def import_module(name: str) -> ModuleType:
    """Import probe (replaceable in tests)."""
    return importlib.import_module(name)


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def backend_problem(name: str) -> str | None:
    """None when the backend ``name`` can run here, else the exact reason it cannot."""
    if name == "mooncake":
        try:
            import_module(MOONCAKE_MODULE)
        except Exception as exc:  # a missing libibverbs.so.1 is an ImportError too
            return f"{MOONCAKE_MODULE} cannot be imported ({_failure(exc)}); {MOONCAKE_INSTALL}"
        return None
    module = ASCEND_MODULES.get(name)
    if module is None:
        return None
    try:
        import_module(module)
    except Exception as exc:  # a broken install raises more than ImportError (missing shared libraries)
        return f"{module} cannot be imported ({_failure(exc)}); {_INSTALL[name]}"
    return None  # the adapter's construction says whether its data path runs here


def _check(kind: str, name: str | None, valid: tuple[str, ...]) -> str | None:
    if name is None:
        return None
    if name not in valid:
        raise ConfigError([f"{kind}: got {describe_value(name)}; must be one of {', '.join(map(repr, valid))}"])
    problem = backend_problem(name)
    if problem is None:
        return None
    return f"{kind} {name!r} cannot run here: {problem}; {_ALTERNATIVES[kind]}"


def require_available(*, backend: str | None = None, transfer_backend: str | None = None) -> None:
    """Raise BackendUnavailableError (naming backend, reason and alternative) unless both can run."""
    reasons = [
        reason
        for reason in (
            _check("backend", backend, STORE_BACKENDS),
            _check("transfer_backend", transfer_backend, TRANSFER_BACKENDS),
        )
        if reason is not None
    ]
    if reasons:
        raise BackendUnavailableError(reasons)


def describe_availability() -> dict[str, str]:
    """Every backend name -> ``"available"`` or the reason it cannot run here (for start-up logs)."""
    names = dict.fromkeys((EMBEDDED, *STORE_BACKENDS, *TRANSFER_BACKENDS))
    return {name: backend_problem(name) or AVAILABLE for name in names}
