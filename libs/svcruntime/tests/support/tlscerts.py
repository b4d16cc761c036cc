"""Throwaway PKI for TLS tests: a CA, a server/peer certificate (also usable as a client
certificate, as every kvoffload service's is), a client certificate, and an unrelated CA with its
own peer certificate. Needs the ``cryptography`` package (the root ``test`` extra)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class PKI:
    ca: Path  # CA certificate
    cert: Path  # peer certificate (serverAuth + clientAuth; SAN 127.0.0.1, ::1, localhost)
    key: Path
    client_cert: Path  # clientAuth only, signed by the same CA
    client_key: Path
    other_ca: Path  # an unrelated CA
    other_cert: Path  # signed by other_ca, same SANs and usages as ``cert``
    other_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert: x509.Certificate | None) -> None:
    if cert is not None:
        path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


def _ca(cn: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(cn: str, ca_key, ca_cert: x509.Certificate, usages: list, sans: bool):
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if sans:
        b = b.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                    x509.DNSName("localhost"),
                ]
            ),
            critical=False,
        )
    return key, b.sign(ca_key, hashes.SHA256())


def make_pki(directory: Path) -> PKI:
    directory.mkdir(parents=True, exist_ok=True)
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    ca_key, ca = _ca("kvoffload test CA")
    other_ca_key, other_ca = _ca("unrelated CA")
    files = {
        "ca": (ca_key, ca),
        "other_ca": (other_ca_key, other_ca),
        "peer": _leaf("kvoffload peer", ca_key, ca, both, sans=True),
        "client": _leaf("kvoffload client", ca_key, ca, [ExtendedKeyUsageOID.CLIENT_AUTH], sans=False),
        "other": _leaf("other peer", other_ca_key, other_ca, both, sans=True),
    }
    for name, (key, cert) in files.items():
        _write(directory / name, key, cert)
    d = directory
    return PKI(
        ca=d / "ca.crt",
        cert=d / "peer.crt",
        key=d / "peer.key",
        client_cert=d / "client.crt",
        client_key=d / "client.key",
        other_ca=d / "other_ca.crt",
        other_cert=d / "other.crt",
        other_key=d / "other.key",
    )
