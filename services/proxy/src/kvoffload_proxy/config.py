"""The proxy's one validated configuration, built once from the command line.

`parse_args(argv)` is the edge: it turns the flags of the feature guide
(`--host --port --prefiller-hosts --prefiller-ports --decoder-hosts --decoder-ports`, lists given
as space-separated values) into a frozen `ProxyConfig`, or raises `ValueError` whose message starts
with the offending flag. Everything else receives the config object, never raw flags.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

WILDCARD_HOSTS = ("0.0.0.0", "::", "", "*", "0")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-_]{0,251}[A-Za-z0-9])?$")
API_KEY_ENV = "KVOFFLOAD_API_KEY"  # the key in the environment keeps it off `ps` and shell history


def is_wildcard(host: str) -> bool:
    """True for an address that means "every interface" (0.0.0.0, ::, empty): it is bindable but
    not reachable, so it can never be the address decoders are told to call."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host.strip() in WILDCARD_HOSTS


def url_host(host: str) -> str:
    """`host` as it appears in a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_host(host: str, flag: str) -> str:
    if is_wildcard(host):
        raise ValueError(
            f"{flag} {host!r} is a wildcard address: decoders call the proxy's /v1/metaserver at "
            "the address it advertises, and a wildcard one is not reachable; give the reachable "
            "address of this host (127.0.0.1 on one machine, the node's IP across machines)"
        )
    try:
        ipaddress.ip_address(host.strip("[]"))
        return host.strip("[]")
    except ValueError:
        if not _HOSTNAME.match(host):
            raise ValueError(f"{flag} {host!r} is neither an IP address nor a host name") from None
        return host


Role = Literal["prefiller", "decoder"]


class Backend(BaseModel):
    """One prefiller or decoder, addressed as http://host:port."""

    model_config = ConfigDict(frozen=True)
    role: Role
    index: int
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"


class ProxyConfig(BaseModel):
    """Field names are the flags without dashes (`request_timeout_s` is `--request-timeout-s`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # inf timeouts hang
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    prefillers: tuple[Backend, ...]
    decoders: tuple[Backend, ...]
    api_key: str | None = None
    metaserver_url: str = ""
    request_timeout_s: float = Field(600.0, gt=0)
    metaserver_timeout_s: float = Field(60.0, gt=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    max_retries: int = Field(3, ge=0, le=20)
    retry_backoff_s: float = Field(0.2, ge=0)
    max_request_bytes: int = Field(32 * 2**20, ge=1024)
    shutdown_grace_s: float = Field(30.0, ge=0)
    prefill_kv_weight: float = Field(0.3, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return check_host(v, "--host")

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, v: str | None) -> str | None:
        if v is not None and (not v or any(c.isspace() for c in v)):
            raise ValueError("must be a non-empty string without whitespace")
        return v

    @field_validator("metaserver_url")
    @classmethod
    def _metaserver_url(cls, v: str) -> str:
        if not v:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{v!r} must be an http(s) URL such as http://10.0.0.5:9000/v1/metaserver")
        if is_wildcard(parts.hostname):
            raise ValueError(f"{v!r} names a wildcard host; decoders cannot reach it")
        return v

    @property
    def advertised_metaserver_url(self) -> str:
        """The URL decoders are told to POST their endpoints to."""
        return self.metaserver_url or f"http://{url_host(self.host)}:{self.port}/v1/metaserver"

    @property
    def backends(self) -> tuple[Backend, ...]:
        return self.prefillers + self.decoders


def _backends(role: Role, hosts: list[str], ports: list[int]) -> tuple[Backend, ...]:
    if len(hosts) != len(ports):
        raise ValueError(
            f"--{role}-ports: {len(ports)} port(s) for {len(hosts)} --{role}-hosts; give one port "
            f"per host, in the same order (e.g. --{role}-hosts 10.0.0.1 10.0.0.2 "
            f"--{role}-ports 8100 8100)"
        )
    out = []
    for i, (host, port) in enumerate(zip(hosts, ports)):
        host = check_host(host, f"--{role}-hosts")
        if not 1 <= port <= 65535:
            raise ValueError(f"--{role}-ports: {port} is not a TCP port (1-65535)")
        out.append(Backend(role=role, index=i, host=host, port=port))
    urls = [b.url for b in out]
    dup = sorted({u for u in urls if urls.count(u) > 1})
    if dup:
        raise ValueError(f"--{role}-hosts/--{role}-ports: {', '.join(dup)} listed more than once")
    return tuple(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvoffload-proxy",
        description="OpenAI-compatible proxy for layerwise P/D serving (decode first: decoders "
        "register at /v1/metaserver, then the proxy dispatches the prefill).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind and advertise to decoders; never a wildcard")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefiller-hosts", nargs="+", required=True, metavar="HOST")
    p.add_argument("--prefiller-ports", nargs="+", type=int, required=True, metavar="PORT")
    p.add_argument("--decoder-hosts", nargs="+", required=True, metavar="HOST")
    p.add_argument("--decoder-ports", nargs="+", type=int, required=True, metavar="PORT")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route but /healthcheck and "
        f"/openapi.json (default ${API_KEY_ENV}; decoders get per-request tokens)",
    )
    p.add_argument(
        "--metaserver-url", default="", help="URL decoders are told to call (default http://HOST:PORT/v1/metaserver)"
    )
    p.add_argument(
        "--request-timeout-s", type=float, default=600.0, help="longest a backend may stay silent during a request"
    )
    p.add_argument(
        "--metaserver-timeout-s",
        type=float,
        default=60.0,
        help="longest wait for every decoder of a request to admit and register it (a child "
        "a decoder reported queued is exempt)",
    )
    p.add_argument("--connect-timeout-s", type=float, default=5.0)
    p.add_argument("--health-timeout-s", type=float, default=2.0)
    p.add_argument(
        "--max-retries", type=int, default=3, help="retries of a backend connection that failed (exponential backoff)"
    )
    p.add_argument("--retry-backoff-s", type=float, default=0.2)
    p.add_argument("--max-request-bytes", type=int, default=32 * 2**20)
    p.add_argument("--shutdown-grace-s", type=float, default=30.0)
    p.add_argument("--prefill-kv-weight", type=float, default=0.3)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def config_from_namespace(ns: argparse.Namespace) -> ProxyConfig:
    fields = {k: v for k, v in vars(ns).items() if not k.startswith(("prefiller_", "decoder_"))}
    fields["prefillers"] = _backends("prefiller", ns.prefiller_hosts, ns.prefiller_ports)
    fields["decoders"] = _backends("decoder", ns.decoder_hosts, ns.decoder_ports)
    own = f"http://{url_host(ns.host.strip('[]'))}:{ns.port}"
    for b in fields["prefillers"] + fields["decoders"]:
        if b.url == own:  # the proxy would forward requests to itself
            raise ValueError(
                f"--{b.role}-hosts/--{b.role}-ports: {own} is this proxy's own --host/--port; "
                f"give the {b.role}'s address"
            )
    try:
        return ProxyConfig(**fields)
    except ValidationError as e:
        err = e.errors()[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "config"
        msg = err["msg"].removeprefix("Value error, ")
        if msg.startswith(flag):
            raise ValueError(msg) from None
        if err["loc"] and err["loc"][0] == "api_key":  # never echo a secret
            raise ValueError(f"{flag}: {msg}") from None
        raise ValueError(f"{flag} {fields.get(str(err['loc'][0]))!r}: {msg}") from None


def parse_args(argv: list[str] | None = None) -> ProxyConfig:
    """Parse and validate; argparse errors exit(2), validation errors raise ValueError."""
    return config_from_namespace(build_parser().parse_args(argv))
