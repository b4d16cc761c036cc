"""A service's command-line flags: those the model services (prefill and decode) declare alike,
and the numeric flags' checks every service runs before anything starts.

A model service's parser opens with ``add_model_service_flags`` (``--version``, ``--model``,
``--served-model-name``, ``--host``, ``--port``), declares the flags both services have with
``add_shared_flag`` (its type and default from ``SHARED_FLAGS``, the help its own where it says
more about that service) among its own, and ends with ``add_process_flags``
(``--shutdown-grace-s``, ``--log-level`` and the TLS flags); so each flag is declared once, in
the order each service's ``--help`` lists it.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from kvcore.config.errors import ConfigError
from svcruntime import tls as kvtls

MAX_PORT = 65535

SHARED_FLAGS: dict[str, dict[str, Any]] = {
    "--max-model-len": dict(type=int, default=16384),
    "--max-num-seqs": dict(type=int, default=8),
    "--block-size": dict(type=int, default=16),
    "--dtype": dict(choices=["bfloat16", "float32"], help="default: the config's torch_dtype"),
    "--tensor-parallel-size": dict(type=int, default=1),
    "--peer-timeout-s": dict(type=float, default=10.0),
}


def add_model_service_flags(p: argparse.ArgumentParser, version: str, *, port: int, peer: str) -> None:
    """``--version``, ``--model``, ``--served-model-name`` (the model id ``peer`` must share),
    ``--host`` and the HTTP ``--port`` (default ``port``)."""
    p.add_argument("--version", action="version", version=f"%(prog)s {version}")
    p.add_argument("--model", required=True, help="model directory (config.json + safetensors)")
    p.add_argument("--served-model-name", help=f"model id shared with the {peer} (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="bind and advertise address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=port, help="HTTP port")


def add_shared_flag(p: argparse.ArgumentParser, name: str, **overrides: Any) -> None:
    """``name`` as ``SHARED_FLAGS`` declares it, with ``overrides`` (a service's own help)."""
    p.add_argument(name, **{**SHARED_FLAGS[name], **overrides})


def add_process_flags(p: argparse.ArgumentParser) -> None:
    """``--shutdown-grace-s``, ``--log-level`` and the TLS flags (``tls.add_tls_arguments``)."""
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM, how long in-flight requests get to finish before they are failed (default 30)",
    )
    p.add_argument("--log-level", default="info")
    kvtls.add_tls_arguments(p)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_flags(
    args: Any,
    *,
    at_least_one: tuple[str, ...] = (),
    at_least_zero: tuple[str, ...] = (),
    seconds: tuple[str, ...] = (),
    seconds_or_zero: tuple[str, ...] = (),
    ports: tuple[str, ...] = (),
    any_ports: tuple[str, ...] = (),
) -> None:
    """The numeric flags of ``args`` (attributes; absent or None ones skipped): ints ``>= 1`` /
    ``>= 0``, finite numbers ``> 0`` / ``>= 0``, TCP ports ``1..65535`` / ``0..65535`` (0: any free
    port). ``ConfigError`` lists every flag that breaks its rule, named as typed."""
    rules = [
        (at_least_one, "an int >= 1", lambda v: _is_int(v) and v >= 1),
        (at_least_zero, "an int >= 0", lambda v: _is_int(v) and v >= 0),
        (seconds, "a finite number > 0", lambda v: _is_number(v) and v > 0),
        (seconds_or_zero, "a finite number >= 0", lambda v: _is_number(v) and v >= 0),
        (ports, "a TCP port in 1..65535", lambda v: _is_int(v) and 1 <= v <= MAX_PORT),
        (any_ports, "a TCP port in 0..65535 (0: any free port)", lambda v: _is_int(v) and 0 <= v <= MAX_PORT),
    ]
    errors = [
        f"--{name.replace('_', '-')}: got {getattr(args, name)!r}; must be {rule}"
        for names, rule, ok in rules
        for name in names
        if getattr(args, name, None) is not None and not ok(getattr(args, name))
    ]
    if errors:
        raise ConfigError(errors)
