"""Secrets mounted as files, and the flags that point at them: the cachestore's TLS and token (both sides)
and the router registry's token (both sides). Paths are the chart's, so the pods look alike either way."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragserve.engine_command import TLSFiles
from ragserve_operator.spec import RAGServeSpec

CACHESTORE_TLS_DIR = "/etc/ragserve/tls"
CACHESTORE_AUTH_DIR = "/etc/ragserve/auth"
CACHESTORE_CA_DIR = "/etc/ragserve/cachestore-ca"
CACHESTORE_CLIENT_DIR = "/etc/ragserve/cachestore-client"
CACHESTORE_TOKEN_DIR = "/etc/ragserve/cachestore-token"
REGISTRY_TOKEN_DIR = "/etc/ragserve/registry-token"


@dataclass
class Mounts:
    """Volumes and volume mounts a container needs, and its flags for them."""

    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)
    args: list[str] = field(default_factory=list)

    def secret(self, volume: str, secret: str, path: str, key: str | None = None) -> None:
        """The Secret as read-only files under `path` (only `key` when given)."""
        source: dict = {"secretName": secret, "defaultMode": 0o440}
        if key:
            source["items"] = [{"key": key, "path": key}]
        self.volumes.append({"name": volume, "secret": source})
        self.mounts.append({"name": volume, "mountPath": path, "readOnly": True})


def cachestore_server(spec: RAGServeSpec) -> Mounts:
    """The cachestore's serving certificate (and client CA for mutual TLS), and its token."""
    cs, out = spec.cachestore, Mounts()
    if cs["tls"]["enabled"]:
        out.secret("tls", cs["tls"]["secretName"], CACHESTORE_TLS_DIR)
        out.args += ["--tls-cert", f"{CACHESTORE_TLS_DIR}/tls.crt", "--tls-key", f"{CACHESTORE_TLS_DIR}/tls.key"]
        if cs["tls"]["clientAuth"]:
            out.args += ["--tls-client-ca", f"{CACHESTORE_TLS_DIR}/ca.crt"]
    if secret := cs["auth"].get("existingSecret"):
        out.secret("auth", secret, CACHESTORE_AUTH_DIR, cs["auth"]["key"])
        out.args += ["--auth-token-file", f"{CACHESTORE_AUTH_DIR}/{cs['auth']['key']}"]
    return out


def cachestore_client(spec: RAGServeSpec) -> tuple[Mounts, TLSFiles, str | None]:
    """An engine's side: the CA it verifies the cachestore with, its client certificate, the token file."""
    cs, out, tls, token = spec.cachestore, Mounts(), TLSFiles(), None
    if not cs["enabled"]:
        return out, tls, token
    if cs["tls"]["enabled"]:
        out.secret("cachestore-ca", cs["tls"]["secretName"], CACHESTORE_CA_DIR, "ca.crt")
        tls = TLSFiles(ca=f"{CACHESTORE_CA_DIR}/ca.crt")
        if cs["tls"]["clientAuth"]:
            out.secret("cachestore-client", cs["tls"]["engineClientSecret"], CACHESTORE_CLIENT_DIR)
            tls = TLSFiles(tls.ca, f"{CACHESTORE_CLIENT_DIR}/tls.crt", f"{CACHESTORE_CLIENT_DIR}/tls.key")
    if secret := cs["auth"].get("existingSecret"):
        out.secret("cachestore-token", secret, CACHESTORE_TOKEN_DIR, cs["auth"]["key"])
        token = f"{CACHESTORE_TOKEN_DIR}/{cs['auth']['key']}"
    return out, tls, token


def registry_token_file(spec: RAGServeSpec) -> str | None:
    """Where router and engines read the registry token (--registry-token-file), when one is set."""
    ref = (spec.router.get("registryAuth") or {}).get("tokenSecret")
    return f"{REGISTRY_TOKEN_DIR}/{ref['key']}" if ref else None


def registry_token(spec: RAGServeSpec) -> Mounts:
    """The registry token's Secret mount and flag, for the router and every engine alike."""
    out = Mounts()
    if path := registry_token_file(spec):
        ref = spec.router["registryAuth"]["tokenSecret"]
        out.secret("registry-token", ref["name"], REGISTRY_TOKEN_DIR, ref["key"])
        out.args += ["--registry-token-file", path]
    return out
