"""The numeric command-line flags of a service, checked before anything starts."""

from __future__ import annotations

import math
from typing import Any

from kvcore.config import ConfigError

MAX_PORT = 65535


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_flags(args: Any, *, at_least_one: tuple[str, ...] = (), at_least_zero: tuple[str, ...] = (),
                seconds: tuple[str, ...] = (), seconds_or_zero: tuple[str, ...] = (), ports: tuple[str, ...] = (),
                any_ports: tuple[str, ...] = ()) -> None:
    """The numeric flags of ``args`` (attributes; absent or None ones skipped): ints ``>= 1`` /
    ``>= 0``, finite numbers ``> 0`` / ``>= 0``, TCP ports ``1..65535`` / ``0..65535`` (0: any free
    port). ``ConfigError`` lists every flag that breaks its rule, named as typed."""
    rules = [(at_least_one, "an int >= 1", lambda v: _is_int(v) and v >= 1),
             (at_least_zero, "an int >= 0", lambda v: _is_int(v) and v >= 0),
             (seconds, "a finite number > 0", lambda v: _is_number(v) and v > 0),
             (seconds_or_zero, "a finite number >= 0", lambda v: _is_number(v) and v >= 0),
             (ports, "a TCP port in 1..65535", lambda v: _is_int(v) and 1 <= v <= MAX_PORT),
             (any_ports, "a TCP port in 0..65535 (0: any free port)", lambda v: _is_int(v) and 0 <= v <= MAX_PORT)]
    errors = [f"--{name.replace('_', '-')}: got {getattr(args, name)!r}; must be {rule}"
              for names, rule, ok in rules for name in names
              if getattr(args, name, None) is not None and not ok(getattr(args, name))]
    if errors:
        raise ConfigError(errors)
