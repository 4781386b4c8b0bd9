"""The endpoint picker's TLS: the given certificate, or one self-signed at start (as upstream pickers do: gateways
connect to a picker with TLS but without verifying it unless configured to)."""

from __future__ import annotations

import datetime
import ipaddress
import socket

import grpc

from ragserve.router_args import RouterConfig
from ragserve.tls import server_credentials


def self_signed(hostname: str) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) of a fresh P-256 key, valid for a year, for `hostname` and loopback."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname[:64])])
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName(hostname), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def credentials(cfg: RouterConfig) -> grpc.ServerCredentials | None:
    """None with --epp-plaintext; --epp-cert-file/--epp-key-file when given; else a self-signed pair."""
    if cfg.epp_plaintext:
        return None
    if cfg.epp_cert_file and cfg.epp_key_file:
        return server_credentials(cfg.epp_cert_file, cfg.epp_key_file, flags="--epp-")
    return grpc.ssl_server_credentials([self_signed(socket.gethostname())])
