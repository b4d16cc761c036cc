"""Field rules of the config models: strict before-validators that raise friendly errors.

No coercion at all: ``"3"`` is not an int, ``2.0`` is not an int, ``true`` is not an int. Each
rule raises ``rule_error`` naming the value, its type and the rule (``kvcore.config.errors``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator

from kvcore.config.errors import describe_value, hint, rule_error


def choice(options: tuple[str, ...], what: str = "", *, optional: bool = False) -> BeforeValidator:
    """One of ``options`` (``what`` prefixes their list in the message); None too when optional."""

    def check(value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, str) and value in options:
            return value
        listed = ", ".join(map(repr, options))
        raise rule_error(f"got {describe_value(value)}; must be one of {what}{listed}{hint(value, options, '; ')}")

    return BeforeValidator(check)


def int_rule(minimum: int, maximum: int | None = None, *, optional: bool = False) -> BeforeValidator:
    """An int (bool rejected, no coercion) in [minimum, maximum]; None too when optional."""
    bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
    rule = f"must be an int {bound}" + (" or null" if optional else "")

    def check(value: Any) -> Any:
        if value is None and optional:
            return None
        in_range = isinstance(value, int) and minimum <= value and (maximum is None or value <= maximum)
        if in_range and not isinstance(value, bool):
            return value
        raise rule_error(f"got {describe_value(value)}; {rule}")

    return BeforeValidator(check)


def _strict_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise rule_error(f"got {describe_value(value)}; must be true or false")


def independent_layers(value: Any) -> Any:
    """``"all"`` or a list of ints (layer indices; negatives count from the end), as a tuple."""
    if value == "all":
        return "all"
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    rule = 'must be "all" or a list of ints (layer indices; negatives count from the end)'
    raise rule_error(f"got {describe_value(value)}; {rule}")


def dram_gib(value: Any) -> Any:
    """Whole GiB, an int > 0."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise rule_error(f'got {describe_value(value)}; must be whole GiB as an integer > 0 (e.g. 128, not 1.5 or "10GB")')


def address(what: str) -> BeforeValidator:
    """``"HOST:PORT"`` (port 1..65535) or None; ``what`` names whose address it is."""

    def check(value: Any) -> Any:
        if value is None:
            return None
        host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
        if sep and host and port.isdigit() and 1 <= int(port) <= 65535:
            return value
        raise rule_error(f'got {describe_value(value)}; must be "HOST:PORT" ({what})')

    return BeforeValidator(check)


def namespace(value: Any) -> Any:
    """A non-empty string without '/' or surrounding spaces, or None."""
    if value is None:
        return None
    if isinstance(value, str) and value and "/" not in value and value.strip() == value:
        return value
    raise rule_error(f"got {describe_value(value)}; must be a non-empty string without '/' or surrounding spaces")


def host(value: Any) -> Any:
    """A host name or address peers can reach (no port, no wildcard), or None."""
    if value is None:
        return None
    wildcard = value in ("0.0.0.0", "::", "[::]") if isinstance(value, str) else False
    with_port = isinstance(value, str) and value.count(":") == 1  # "host:port" (IPv6 has more colons)
    if isinstance(value, str) and value.strip() == value and value and not wildcard and not with_port:
        return value
    raise rule_error(
        f"got {describe_value(value)}; must be a host name or address the peers can reach, without a "
        "port (not a wildcard such as 0.0.0.0)"
    )


def positive_seconds(value: Any) -> Any:
    """A number of seconds > 0 (as a float), or None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise rule_error(f"got {describe_value(value)}; must be a number of seconds > 0")


def positive_gib(value: Any) -> Any:
    """A number of GiB > 0 (as a float), or None."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise rule_error(f"got {describe_value(value)}; must be a number of GiB > 0 (e.g. 1 or 0.5)")


StrictBool = Annotated[bool, BeforeValidator(_strict_bool)]
