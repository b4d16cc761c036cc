"""Availability checks of the host-pool and P→D transfer backends named in user configs.

The embedded ``"kvoffload"`` backends (host pool, P→D data path) run everywhere. Every other
backend runs wherever the module its probe names imports (``ImportProbe``): a host-pool backend's
probe is its ``kvcore.pool.registry`` entry's (``"mooncake"``: ``mooncake.store``, the wheel
``mooncake-transfer-engine-non-cuda`` plus Debian's ``libibverbs1``, no NPU needed; its master is
checked when the pool connects; ``"memcache"``: ``memcache_hybrid``), a transfer backend's its
``kvcore.transferregistry`` entry's (``"memfabric"``: ``memfabric_hybrid``; ``"mooncake"``:
``mooncake.engine``, the same wheel as Mooncake Store's). Whether the Ascend backends' data path
runs here (it needs an Ascend NPU driver) is decided by the adapter's own construction, the single
source of truth, which fails with the library's reason at start-up. Services call
``require_available`` at start-up: a backend that cannot run here is an error that says exactly why
(missing module and how to install it) and names the embedded alternative, never a silent
substitution. The import probe (``import_module``) is module-level so tests can replace it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvcore.config.errors import ConfigError, describe_value
from kvcore.pool.registry import EMBEDDED, POOL_BACKENDS, STORE_BACKENDS, ImportProbe
from kvcore.transferregistry import TRANSFER_NAMES, TRANSFERS

AVAILABLE = "available"

_ALTERNATIVES = {
    "backend": f"use backend {EMBEDDED!r} (the embedded host pool managed by kvoffload-metastore)",
    "transfer_backend": f"use transfer_backend {EMBEDDED!r} ({TRANSFERS[EMBEDDED].summary})",
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


def _probe(name: str, kind: str) -> ImportProbe | None:
    """The probe of ``name``'s entry in the registry of ``kind`` ("backend": host pools, else transfers)."""
    entry = POOL_BACKENDS.get(name) if kind == "backend" else TRANSFERS.get(name)
    return entry.probe if entry is not None else None


def backend_problem(name: str, kind: str = "backend") -> str | None:
    """None when the backend ``name`` (of ``kind``: "backend", the host pool's, or "transfer_backend")
    can run here, else the exact reason it cannot."""
    probe = _probe(name, kind)
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
    problem = backend_problem(name, kind)
    if problem is None:
        return None
    return f"{kind} {name!r} cannot run here: {problem}; {_ALTERNATIVES[kind]}"


def require_available(*, backend: str | None = None, transfer_backend: str | None = None) -> None:
    """Raise BackendUnavailableError (naming backend, reason and alternative) unless both can run."""
    reasons = [
        reason
        for reason in (
            _check("backend", backend, STORE_BACKENDS),
            _check("transfer_backend", transfer_backend, TRANSFER_NAMES),
        )
        if reason is not None
    ]
    if reasons:
        raise BackendUnavailableError(reasons)


def describe_availability() -> dict[str, str]:
    """Every backend name -> ``"available"`` or the reason it cannot run here (for start-up logs); a
    name of both registries (``"mooncake"``) reports its host-pool backend's."""
    out = {name: backend_problem(name) or AVAILABLE for name in STORE_BACKENDS}
    for name in TRANSFER_NAMES:
        out.setdefault(name, backend_problem(name, "transfer_backend") or AVAILABLE)
    return out
