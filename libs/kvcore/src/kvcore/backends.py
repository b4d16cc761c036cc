"""Availability checks of the host-pool and P→D transfer backends named in user configs.

The embedded ``"kvoffload"`` backends (host pool, P→D data path) run everywhere. Every other
backend runs wherever the module its probe names imports (``ImportProbe``): a host-pool backend's
probe is its ``kvcore.poolregistry`` entry's (``"mooncake"``: ``mooncake.store``, the wheel
``mooncake-transfer-engine-non-cuda`` plus Debian's ``libibverbs1``, no NPU needed; its master is
checked when the pool connects; ``"memcache"``: ``memcache_hybrid``), the transfer backend
``"memfabric"`` (the P→D layer pull over memfabric_hybrid's TransferEngine, ``pdlink.memfabric``)
needs ``memfabric_hybrid``, the transfer backend ``"mooncake"`` (over Mooncake Transfer Engine,
``pdlink.mooncake``) ``mooncake.engine``, the same wheel as Mooncake Store's. Whether the Ascend
backends' data path runs here (it needs an Ascend NPU driver) is decided by the adapter's own
construction, the single source of truth, which fails with
the library's reason at start-up. Services call ``require_available`` at start-up: a backend that
cannot run here is an error that says exactly why (missing module and how to install it) and names
the embedded alternative, never a silent substitution. The import probe (``import_module``) is
module-level so tests can replace it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvcore.configerrors import ConfigError, describe_value
from kvcore.confignames import TRANSFER_BACKENDS
from kvcore.poolregistry import EMBEDDED, MOONCAKE_INSTALL, POOL_BACKENDS, STORE_BACKENDS, ImportProbe

AVAILABLE = "available"

MEMFABRIC_INSTALL = "install MemFabric: scripts/install-memcache (it runs `pip install memfabric_hybrid==1.3.0`)"
_TRANSFER_PROBES = {
    "memfabric": ImportProbe("memfabric_hybrid", MEMFABRIC_INSTALL),
    "mooncake": ImportProbe("mooncake.engine", MOONCAKE_INSTALL),
}

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


def _probe(name: str) -> ImportProbe | None:
    pool = POOL_BACKENDS.get(name)
    return pool.probe if pool is not None else _TRANSFER_PROBES.get(name)


def backend_problem(name: str) -> str | None:
    """None when the backend ``name`` can run here, else the exact reason it cannot."""
    probe = _probe(name)
    if probe is None:
        return None
    try:
        import_module(probe.module)
    except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError (a missing .so)
        return f"{probe.module} cannot be imported ({_failure(exc)}); {probe.install}"
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
