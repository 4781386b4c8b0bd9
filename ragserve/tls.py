"""TLS from PEM files: gRPC credentials, server side (optionally requiring client certificates) and channel side;
for HTTP, uvicorn's server settings and the SSL context an httpx client verifies servers with (and presents its
own certificate from, for mutual TLS).

A file that cannot be read is a ValueError naming the flag it came from, e.g. "cannot read --tls-cert x.pem: ...".
`flags` is the command-line prefix of the three files: "--tls-" gives --tls-cert, --tls-key, --tls-client-ca / --tls-ca.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import grpc


def read_pem(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None


def server_credentials(
    cert: str, key: str, client_ca: str | None = None, flags: str = "--tls-"
) -> grpc.ServerCredentials:
    """A certificate/key pair; with `client_ca`, clients must present a certificate signed by it (mutual TLS)."""
    pair = (read_pem(key, f"{flags}key"), read_pem(cert, f"{flags}cert"))
    ca = read_pem(client_ca, f"{flags}client-ca") if client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(
    ca: str | None = None, cert: str | None = None, key: str | None = None, flags: str = "--tls-"
) -> grpc.ChannelCredentials:
    """Verify the server against `ca` (default: the system roots); `cert` and `key` for mutual TLS."""

    def read(path: str | None, what: str) -> bytes | None:
        return read_pem(path, f"{flags}{what}") if path else None

    return grpc.ssl_channel_credentials(read(ca, "ca"), read(key, "key"), read(cert, "cert"))


def uvicorn_tls(cert: str | None, key: str | None, client_ca: str | None = None) -> dict[str, Any]:
    """uvicorn.Config's TLS settings: none without `cert`; with `client_ca`, clients must present a certificate
    signed by it (mutual TLS) or the handshake fails."""
    if not cert:
        return {}
    out: dict[str, Any] = {"ssl_certfile": cert, "ssl_keyfile": key}
    if client_ca:
        out |= {"ssl_ca_certs": client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return out


def client_ssl(ca: str | None, cert: str | None = None, key: str | None = None, flags: str = "") -> ssl.SSLContext:
    """An HTTPS client's context: verify servers against `ca` (default: the system roots); present `cert`/`key`."""
    try:
        context = ssl.create_default_context(cafile=ca)
        if cert:
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load {flags or 'TLS'} files: {exc}") from None
    return context
