"""TLS and mutual TLS for every gRPC server and client of kvoffload, in one place.

Every service takes the same three flags (``add_tls_arguments``):

``--tls-cert PATH``  this process's certificate chain (PEM). Its server identity, and the client
                     certificate it presents when it calls another service.
``--tls-key PATH``   the private key of ``--tls-cert`` (PEM).
``--tls-ca PATH``    CA bundle (PEM). On a server: client certificates are required and verified
                     against it (mTLS). On a client: the roots that verify the server's certificate
                     (without it, the system roots).

No flag: plain gRPC, exactly as before (services bind 127.0.0.1 by default). Files are read once,
at start-up; a config error (a key without its certificate, an unreadable file, a file that is not
PEM) is a ``TLSConfigError`` that names the flag and the path.

Servers call ``add_port(server, address, tls)``; clients open channels with
``secure_or_insecure_channel(target, tls)``. A service's ``main`` calls ``configure(tls)`` once, so
that clients deep inside libraries (the metastore client of a host pool, a prefill's link to a
decode, a decode's streamed pull) use the process's TLS without threading it through every
constructor: their default ``tls=PROCESS`` means "what ``configure`` set" (plain when never called).

The certificate of a service that is both server and client (prefill, decode) is used both ways:
give it both the ``serverAuth`` and ``clientAuth`` extended key usages (or none), and a subject
alternative name for every address its peers dial (e.g. ``IP:127.0.0.1``, or the host name).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

__all__ = [
    "PROCESS",
    "TLSConfig",
    "TLSConfigError",
    "add_port",
    "add_tls_arguments",
    "configure",
    "current",
    "from_args",
    "secure_or_insecure_channel",
]

FLAGS = {"cert": "--tls-cert", "key": "--tls-key", "ca": "--tls-ca"}


class TLSConfigError(ValueError):
    """A TLS flag is missing, unreadable or not PEM; the message names the flag and the path."""


class _Process:
    def __repr__(self) -> str:
        return "PROCESS"


PROCESS: Any = _Process()  # "the TLS configured for this process" (see ``configure``)
_process_tls: TLSConfig | None = None


def _read_pem(flag: str, path: str | Path, markers: Sequence[str], what: str) -> bytes:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TLSConfigError(f"{flag} {p}: cannot read: {e.strerror or e}") from None
    if not any(m.encode() in data for m in markers):
        raise TLSConfigError(f"{flag} {p}: not a PEM {what} (no '{markers[0]}' line)")
    return data


@dataclass(frozen=True)
class TLSConfig:
    """Loaded PEM bytes (``cert``/``key``/``ca``, each optional) and the paths they came from."""

    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    cert_path: str | None = None
    key_path: str | None = None
    ca_path: str | None = None

    def __repr__(self) -> str:  # never print key material
        return f"TLSConfig(cert={self.cert_path!r}, key={self.key_path!r}, ca={self.ca_path!r})"

    @classmethod
    def load(
        cls, cert: str | Path | None = None, key: str | Path | None = None, ca: str | Path | None = None
    ) -> TLSConfig | None:
        """The config of the three flags' paths; ``None`` when none is given (plain gRPC)."""
        cert, key, ca = (str(v) if v else None for v in (cert, key, ca))
        if not (cert or key or ca):
            return None
        if key and not cert:
            raise TLSConfigError(
                "--tls-key given without --tls-cert: the private key needs the certificate (chain) it belongs to"
            )
        if cert and not key:
            raise TLSConfigError("--tls-cert given without --tls-key: the certificate needs its private key")
        cert_pem = _read_pem(FLAGS["cert"], cert, ["-----BEGIN CERTIFICATE-----"], "certificate") if cert else None
        key_pem = _read_pem(FLAGS["key"], key, ["PRIVATE KEY-----"], "private key") if key else None
        ca_pem = _read_pem(FLAGS["ca"], ca, ["-----BEGIN CERTIFICATE-----"], "CA certificate bundle") if ca else None
        return cls(cert_pem, key_pem, ca_pem, cert, key, ca)

    @property
    def has_identity(self) -> bool:
        return self.cert is not None

    @property
    def mutual(self) -> bool:
        """A server built from this config requires and verifies client certificates."""
        return self.ca is not None

    def require_identity(self, service: str) -> tuple[bytes, bytes]:
        """The (key, certificate chain) pair, for a process that serves gRPC; an error when it has
        only ``--tls-ca``."""
        if self.key is None or self.cert is None:
            raise TLSConfigError(
                f"--tls-ca given without --tls-cert/--tls-key: {service} serves gRPC and needs a "
                "certificate and key of its own to serve it over TLS"
            )
        return self.key, self.cert

    def server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.ssl_server_credentials(
            [self.require_identity("this server")], root_certificates=self.ca, require_client_auth=self.mutual
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verify servers against ``ca`` (system roots without it); present ``cert``/``key`` when given."""
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def flags(self) -> list[str]:
        """The command-line flags that give this config to a service."""
        out: list[str] = []
        for name, path in (("cert", self.cert_path), ("key", self.key_path), ("ca", self.ca_path)):
            if path:
                out += [FLAGS[name], path]
        return out

    def describe(self) -> dict[str, Any]:
        """For the start-up log line: paths and mode, never key material."""
        return {"tls": True, "mtls": self.mutual, "tls_cert": self.cert_path, "tls_ca": self.ca_path}


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("TLS (gRPC)", "without these flags every gRPC port and call is plain")
    g.add_argument(
        "--tls-cert",
        metavar="PATH",
        help="certificate chain (PEM): server identity, and client certificate for outgoing calls",
    )
    g.add_argument("--tls-key", metavar="PATH", help="private key of --tls-cert (PEM)")
    g.add_argument(
        "--tls-ca",
        metavar="PATH",
        help="CA bundle (PEM): servers require and verify client certificates against it (mTLS); "
        "clients verify servers against it (default: the system roots)",
    )


def from_args(args: argparse.Namespace, serving: str | None = None) -> TLSConfig | None:
    """The config of the parsed flags; ``serving`` (who serves gRPC with it) also requires a
    certificate and key of its own whenever any flag is given."""
    tls = TLSConfig.load(getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_ca", None))
    if tls is not None and serving is not None:
        tls.require_identity(serving)
    return tls


def configure(tls: TLSConfig | None) -> None:
    """Set the process's TLS (``PROCESS`` resolves to it); a service's ``main`` calls it once."""
    global _process_tls
    _process_tls = tls


def current() -> TLSConfig | None:
    return _process_tls


def _resolve(tls: TLSConfig | None) -> TLSConfig | None:
    return _process_tls if tls is PROCESS else tls


# Peers of a serving stack restart (a crash, a deploy): reconnect within a second instead of after
# gRPC's default exponential backoff (up to 120 s), during which every call fails at once.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def secure_or_insecure_channel(
    target: str, tls: TLSConfig | None = PROCESS, options: Sequence[tuple[str, Any]] | None = None
) -> grpc.Channel:
    """A channel to ``host:port``: TLS (mTLS when ``tls`` has a certificate) or plain when ``tls`` is None."""
    import grpc

    tls = _resolve(tls)
    given = {k for k, _ in options or ()}
    opts = list(options or ()) + [kv for kv in RECONNECT_OPTIONS if kv[0] not in given]
    if tls is None:
        return grpc.insecure_channel(target, options=opts)
    return grpc.secure_channel(target, tls.channel_credentials(), options=opts)


def add_port(server: grpc.Server, address: str, tls: TLSConfig | None = PROCESS) -> int:
    """Bind ``address`` on ``server``, over TLS when ``tls`` is set; returns the bound port."""
    tls = _resolve(tls)
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())
