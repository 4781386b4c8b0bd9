"""gRPC TLS credentials from PEM files: server side (optionally requiring client certificates) and channel side.

A file that cannot be read is a ValueError naming the flag it came from, e.g. "cannot read --tls-cert x.pem: ...".
`flags` is the command-line prefix of the three files: "--tls-" gives --tls-cert, --tls-key, --tls-client-ca / --tls-ca.
"""

from __future__ import annotations

from pathlib import Path

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
