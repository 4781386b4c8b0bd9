"""A throwaway PKI for TLS tests, generated with `cryptography`: CA, server and client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ragserve.tls import channel_credentials


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, usage=None, sans=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key) -> tuple[Path, Path]:
    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    key_path.write_bytes(pem)
    return cert_path, key_path


def write_test_pki(root: Path) -> dict[str, Path]:
    """ca, server (127.0.0.1 / localhost), client (signed by ca), rogue_client (signed by another CA) and peer
    (127.0.0.1 / localhost, no extended key usage: one certificate that serves and connects, as `ragserve up`'s)."""
    out: dict[str, Path] = {}
    cas = {}
    for name in ("ca", "rogue_ca"):
        key = ec.generate_private_key(ec.SECP256R1())
        cas[name] = key
        out[name], _ = _write(root / name, _cert(f"test {name}", key, f"test {name}", key, ca=True), key)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    leaves = {
        "server": ("ca", ExtendedKeyUsageOID.SERVER_AUTH, sans),
        "client": ("ca", ExtendedKeyUsageOID.CLIENT_AUTH, None),
        "rogue_client": ("rogue_ca", ExtendedKeyUsageOID.CLIENT_AUTH, None),
        "peer": ("ca", None, sans),
    }
    for name, (issuer, usage, alt) in leaves.items():
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(name, key, f"test {issuer}", cas[issuer], usage=usage, sans=alt)
        out[f"{name}_cert"], out[f"{name}_key"] = _write(root / name, cert, key)
    return out


def client_credentials(certs: dict[str, Path], client: str | None = None, ca: str = "ca") -> grpc.ChannelCredentials:
    """Channel credentials from write_test_pki's files: trust `ca`; present `client`'s certificate if given."""
    pair = (str(certs[f"{client}_cert"]), str(certs[f"{client}_key"])) if client else (None, None)
    return channel_credentials(str(certs[ca]), *pair)
