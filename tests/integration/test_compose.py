"""compose.yaml, read as Compose reads it (YAML plus `${VAR:-default}` interpolation), with no Docker:
`docker-compose up` publishes nothing beyond the host's loopback unless the user opts in with
KVOFFLOAD_PUBLISH_HOST, and the proxy's API key ($KVOFFLOAD_API_KEY) is passed through to it,
never set empty (the proxy refuses an empty key).

compose.mooncake.yaml (the prefill's host pool on Mooncake Store) likewise, and: a mooncake-master
in place of the metastore, bound as the prefill's config needs it (the command kvoffload's own
launcher would run), the prefill's command the image's default but for the pool, the other
services compose.yaml's, and the images' pins and commands matching (docker/Dockerfile)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
import yaml

from kvcore.config.connectors import StoreConnectorConfig
from kvoffload_proxy.config import API_KEY_ENV
from kvoffload_testing.connector_configs import prefill_kv_transfer_config
from poolbackends.mooncake_master import MasterConfig, master_argv

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
MOONCAKE = ROOT / "compose.mooncake.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
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


def load(env: dict[str, str], path: Path = COMPOSE) -> dict:
    return interpolate(yaml.safe_load(path.read_text()), env)


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
    return {
        name: [published(p) for p in svc.get("ports", [])]
        for name, svc in config["services"].items()
        if svc.get("ports")
    }


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


@pytest.mark.parametrize(
    "port, expected",
    [
        ("9000:9000", ("", "9000", "9000")),
        ("9000", ("", "", "9000")),
        ("127.0.0.1:9000:9000/tcp", ("127.0.0.1", "9000", "9000")),
        ("[::1]:9000:9000", ("::1", "9000", "9000")),
        ({"target": 9000, "published": 9000, "host_ip": "127.0.0.1"}, ("127.0.0.1", "9000", "9000")),
        ({"target": 9000, "published": 9000}, ("", "9000", "9000")),
    ],
)
def test_port_syntax(port, expected):
    assert published(port) == expected


def test_interpolation():
    assert interpolate("${A:-x}:${B-y}:${C}:$$D", {"B": ""}) == "x:::$D"
    assert interpolate("${A:-x}", {"A": "a"}) == "a" and interpolate("$${A}", {}) == "${A}"
    with pytest.raises(AssertionError):
        interpolate("${A:?required}", {})


# -- compose.mooncake.yaml ---------------------------------------------------------------------------


def dockerfile_cmd(target: str) -> list[str]:
    """The default command (exec form) of one docker/Dockerfile target."""
    stage = re.split(r"(?m)^FROM ", DOCKERFILE.read_text())
    [body] = [b for b in stage if re.match(rf"\S+ AS {re.escape(target)}\s*\n", b)]
    joined = re.sub(r"\\\n\s*", " ", body)  # line continuations
    [cmd] = re.findall(r"(?m)^CMD (\[.*\])\s*$", joined)
    return json.loads(cmd)


def flag(argv: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")] or [
        argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name
    ]
    return value


def test_the_mooncake_variant_publishes_only_the_proxy_on_loopback_by_default():
    pubs = publications(load({}, MOONCAKE))
    assert pubs == {"proxy": [("127.0.0.1", "9000", "9000")]}, pubs
    assert publications(load({"KVOFFLOAD_PUBLISH_HOST": ""}, MOONCAKE)) == pubs
    assert publications(load({"KVOFFLOAD_PUBLISH_HOST": "0.0.0.0"}, MOONCAKE)) == {
        "proxy": [("0.0.0.0", "9000", "9000")]
    }
    services = load({}, MOONCAKE)["services"]
    assert not any("expose" in svc for svc in services.values())
    assert services["proxy"]["environment"] == [API_KEY_ENV]
    assert not any(API_KEY_ENV in str(svc.get("environment", "")) for n, svc in services.items() if n != "proxy")


def test_the_mooncake_variant_is_compose_yaml_with_a_master_in_place_of_the_metastore():
    base, variant = load({}), load({}, MOONCAKE)
    assert set(variant["services"]) == set(base["services"]) - {"metastore"} | {"mooncake-master"}
    for name in ("decode", "proxy"):
        assert variant["services"][name] == base["services"][name], name
    assert variant["networks"] == base["networks"] and variant["volumes"] == base["volumes"]
    prefill = dict(variant["services"]["prefill"])
    assert prefill.pop("depends_on") == {"mooncake-master": {"condition": "service_healthy"}}
    prefill.pop("command")
    assert prefill == {k: v for k, v in base["services"]["prefill"].items() if k != "depends_on"}
    master = variant["services"]["mooncake-master"]
    assert master["image"] == "kvoffload/mooncake-master:0.1.0" and master["hostname"] == "mooncake-master"
    assert master["build"]["target"] == "mooncake-master"
    assert {k: master[k] for k in ("init", "stop_grace_period", "restart", "networks")} == {
        k: base["services"]["metastore"][k] for k in ("init", "stop_grace_period", "restart", "networks")
    }
    assert (
        load({"KVOFFLOAD_IMAGE_TAG": "t"}, MOONCAKE)["services"]["mooncake-master"]["image"]
        == "kvoffload/mooncake-master:t"
    )


def test_the_mooncake_prefill_names_the_master_and_is_the_image_default_but_for_the_pool():
    services = load({}, MOONCAKE)["services"]
    command = services["prefill"]["command"]
    kv = command[command.index("--kv-transfer-config") + 1]
    master = "mooncake-master:50051"
    assert json.loads(kv) == json.loads(prefill_kv_transfer_config(20050, mooncake_master=master))
    store = json.loads(kv)["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert StoreConnectorConfig.model_validate(store).mooncake_master == master
    assert "--metastore" not in command  # an error with backend "mooncake"
    # the image's default command (docker/Dockerfile), without --metastore and with this store config
    default = dockerfile_cmd("prefill")
    i = default.index("--metastore")
    assert default[i + 1] == "metastore:5000"
    expected = default[:i] + default[i + 2 :]
    expected[expected.index("--kv-transfer-config") + 1] = kv
    assert command == expected
    # the master it names: that service, on the port its master listens on, reachable by name
    host, port = master.rsplit(":", 1)
    assert host in services and services[host]["hostname"] == host
    assert flag(services[host]["command"], "--rpc_port") == port


def test_the_master_binds_what_the_prefill_reaches_and_runs_like_kvoffload_up():
    services = load({}, MOONCAKE)["services"]
    command = services["mooncake-master"]["command"]
    # both servers bound explicitly, to the container's addresses (the compose network: the prefill
    # reaches mooncake-master:50051, the healthcheck the metrics port on loopback); nothing published
    assert flag(command, "--rpc_address") == flag(command, "--metrics_host") == "0.0.0.0"
    assert "ports" not in services["mooncake-master"]
    assert flag(command, "--enable_http_metadata_server") == "false"  # the prefills use the P2P handshake
    # the prefill's lease refresh assumes the master's lease TTL
    kv = services["prefill"]["command"][services["prefill"]["command"].index("--kv-transfer-config") + 1]
    store = json.loads(kv)["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert (
        int(flag(command, "--default_kv_lease_ttl")) == StoreConnectorConfig.model_validate(store).mooncake_lease_ttl_ms
    )
    # the command kvoffload's launcher (poolbackends.mooncake_master) builds for that host and those ports,
    # and the image's default command
    config = MasterConfig(host="0.0.0.0", rpc_port=50051, metrics_port=9003)
    assert command == master_argv("mooncake_master", config, 50051, 9003)
    assert command == dockerfile_cmd("mooncake-master")


def test_the_images_install_the_mooncake_wheel_poolbackends_pins():
    extra = tomllib.loads((ROOT / "libs/poolbackends/pyproject.toml").read_text())["project"]["optional-dependencies"]
    [pin] = extra["mooncake"]
    assert re.search(rf"(?m)^ARG MOONCAKE_WHEEL={re.escape(pin)}$", DOCKERFILE.read_text())


def test_the_variant_is_documented_in_the_files():
    assert "compose.mooncake.yaml" in COMPOSE.read_text().split("\nservices:")[0]
    header = MOONCAKE.read_text().split("\nservices:")[0]
    assert "compose.mooncake.yaml" in header and "KVOFFLOAD_PUBLISH_HOST" in header and API_KEY_ENV in header
