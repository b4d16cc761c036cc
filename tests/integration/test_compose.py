"""compose.yaml, read as Compose reads it (YAML plus `${VAR:-default}` interpolation), with no Docker:
`docker-compose up` publishes nothing beyond the host's loopback unless the user opts in with
KVOFFLOAD_PUBLISH_HOST, and the proxy's API key ($KVOFFLOAD_API_KEY) is passed through to it,
never set empty (the proxy refuses an empty key)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from kvoffload_proxy.config import API_KEY_ENV

COMPOSE = Path(__file__).resolve().parents[2] / "compose.yaml"
# ${VAR}, ${VAR:-default} (unset or empty), ${VAR-default} (unset), and $$ (a literal $)
_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """`value` with Compose's variable substitution done, as `docker-compose config` would."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op = m.group("name"), m.group("op")
        if op == ":-" and not env.get(name) or op == "-" and name not in env:
            return m.group("default")
        return env.get(name, "")

    assert "${" not in _VAR.sub("", value), f"unsupported interpolation in {value!r}"
    return _VAR.sub(sub, value)


def load(env: dict[str, str]) -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env)


def published(port) -> tuple[str, str, str]:
    """(host ip, published port, container port) of one `ports:` entry; host ip "" = every
    interface (Docker's default when none is given)."""
    if isinstance(port, dict):  # long syntax
        return str(port.get("host_ip", "")), str(port.get("published", "")), str(port["target"])
    spec = str(port).split("/")[0]
    parts = spec.rsplit(":", 2)
    host, pub, target = ([""] * (3 - len(parts)) + parts) if len(parts) < 3 else parts
    return host.strip("[]"), pub, target


def publications(config: dict) -> dict[str, list[tuple[str, str, str]]]:
    return {name: [published(p) for p in svc.get("ports", [])]
            for name, svc in config["services"].items() if svc.get("ports")}


def test_only_the_proxy_is_published_and_on_loopback_by_default():
    pubs = publications(load({}))
    assert pubs == {"proxy": [("127.0.0.1", "9000", "9000")]}, pubs
    # an empty variable is "not set", not "every interface"
    assert publications(load({"KVOFFLOAD_PUBLISH_HOST": ""})) == pubs


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10"])
def test_publishing_beyond_loopback_is_an_opt_in(host):
    assert publications(load({"KVOFFLOAD_PUBLISH_HOST": host})) == {"proxy": [(host, "9000", "9000")]}


def test_the_api_key_is_passed_through_never_set_empty():
    """`environment: [KVOFFLOAD_API_KEY]` (no value): Compose copies the variable from its own
    environment when set and leaves it unset in the container otherwise. A `KEY: ${KEY:-}` form would
    set it empty when unset, and the proxy refuses an empty key: the default `up` would fail."""
    assert API_KEY_ENV == "KVOFFLOAD_API_KEY"  # the variable the proxy reads (--api-key's default)
    env = load({})["services"]["proxy"].get("environment")
    entries = env if isinstance(env, list) else [k if v is None else f"{k}={v}" for k, v in (env or {}).items()]
    assert API_KEY_ENV in entries, env
    assert not any(e.startswith(f"{API_KEY_ENV}=") for e in entries), env
    for name, svc in load({})["services"].items():  # no other container gets the key
        if name != "proxy":
            assert API_KEY_ENV not in str(svc.get("environment", "")), name


def test_the_opt_in_is_documented_in_the_file():
    text = COMPOSE.read_text()
    header = text.split("\nservices:")[0]
    assert "KVOFFLOAD_PUBLISH_HOST" in header and API_KEY_ENV in header


@pytest.mark.parametrize("port, expected", [
    ("9000:9000", ("", "9000", "9000")), ("9000", ("", "", "9000")),
    ("127.0.0.1:9000:9000/tcp", ("127.0.0.1", "9000", "9000")), ("[::1]:9000:9000", ("::1", "9000", "9000")),
    ({"target": 9000, "published": 9000, "host_ip": "127.0.0.1"}, ("127.0.0.1", "9000", "9000")),
    ({"target": 9000, "published": 9000}, ("", "9000", "9000"))])
def test_port_syntax(port, expected):
    assert published(port) == expected


def test_interpolation():
    assert interpolate("${A:-x}:${B-y}:${C}:$$D", {"B": ""}) == "x:::$D"
    assert interpolate("${A:-x}", {"A": "a"}) == "a" and interpolate("$${A}", {}) == "${A}"
    with pytest.raises(AssertionError):
        interpolate("${A:?required}", {})
