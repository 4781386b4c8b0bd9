"""Building blocks of a component's command line (engine, router, cachestore): flag values as text,
--flag VALUE pairs, --flag / --no-flag switches and client TLS files. Each component's command is built
once from these (ragserve.engine_command, ragserve.router_command, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragserve.flags import flag_of


@dataclass(frozen=True)
class TLSFiles:
    """Client-side TLS files; ca alone is TLS, with cert and key it is mutual TLS."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


def scalar(value: Any) -> str:
    """A flag value as text; whole floats as integers (YAML and JSON numbers may arrive as floats)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def arg(name: str, value: Any) -> list[str]:
    """[--flag, value] for a field name, or nothing when the value is unset (None or "")."""
    return [] if value is None or value == "" else [flag_of(name), scalar(value)]


def bool_flag(name: str, value: bool | None) -> list[str]:
    """--flag when True, --no-flag when False, nothing when unset (None)."""
    if value is None:
        return []
    return [flag_of(name) if value else "--no-" + flag_of(name)[2:]]


def switch(name: str, on: bool) -> list[str]:
    """--flag when on, else nothing (a store_true flag, which has no --no-flag)."""
    return [flag_of(name)] if on else []


def tls_flags(peer: str, files: TLSFiles) -> list[str]:
    """--<peer>-tls-ca/-cert/-key for the files that are set."""
    return [a for part in ("ca", "cert", "key") for a in arg(f"{peer}_tls_{part}", getattr(files, part))]


@dataclass(frozen=True)
class ServingTLS:
    """A server's TLS files (cachestore, router registry): cert and key serve TLS; client_ca adds mutual TLS."""

    cert: str | None = None
    key: str | None = None
    client_ca: str | None = None


def serving_tls_flags(files: ServingTLS) -> list[str]:
    """--tls-cert/--tls-key/--tls-client-ca for the files that are set."""
    return arg("tls_cert", files.cert) + arg("tls_key", files.key) + arg("tls_client_ca", files.client_ca)
