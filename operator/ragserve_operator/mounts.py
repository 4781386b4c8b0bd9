"""Secrets mounted as files, and the flags that point at them: the cachestore's TLS and token (both sides)
and the router registry's TLS and token (both sides). Paths are the chart's, so the pods look alike either way."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragserve.command_line import ServingTLS, TLSFiles
from ragserve_operator.spec import RAGServeSpec

SERVING_TLS_DIR = "/etc/ragserve/tls"  # a server's own certificate: the cachestore's, or the router registry's
CACHESTORE_AUTH_DIR = "/etc/ragserve/auth"
CACHESTORE_TOKEN_DIR = "/etc/ragserve/cachestore-token"
REGISTRY_TOKEN_DIR = "/etc/ragserve/registry-token"


@dataclass
class Mounts:
    """Volumes and volume mounts a container needs (its flags for them come from the component's command)."""

    volumes: list[dict] = field(default_factory=list)
    mounts: list[dict] = field(default_factory=list)

    def secret(self, volume: str, secret: str, path: str, key: str | None = None) -> None:
        """The Secret as read-only files under `path` (only `key` when given)."""
        source: dict = {"secretName": secret, "defaultMode": 0o440}
        if key:
            source["items"] = [{"key": key, "path": key}]
        self.volumes.append({"name": volume, "secret": source})
        self.mounts.append({"name": volume, "mountPath": path, "readOnly": True})

    def add(self, *others: Mounts) -> Mounts:
        """These mounts plus the others' volumes and mounts (in that order)."""
        for other in others:
            self.volumes += other.volumes
            self.mounts += other.mounts
        return self


def serving_tls_files(tls: dict, out: Mounts) -> ServingTLS:
    """A server's certificate (and, with clientAuth, the CA client certificates must chain to), mounted."""
    if not tls["enabled"]:
        return ServingTLS()
    out.secret("tls", tls["secretName"], SERVING_TLS_DIR)
    client_ca = f"{SERVING_TLS_DIR}/ca.crt" if tls["clientAuth"] else None
    return ServingTLS(f"{SERVING_TLS_DIR}/tls.crt", f"{SERVING_TLS_DIR}/tls.key", client_ca)


def client_tls(tls: dict, peer: str, out: Mounts) -> TLSFiles:
    """A client's side of `peer`'s TLS: the CA it verifies the server with and, for mutual TLS, its certificate."""
    if not tls["enabled"]:
        return TLSFiles()
    ca_dir, client_dir = f"/etc/ragserve/{peer}-ca", f"/etc/ragserve/{peer}-client"
    out.secret(f"{peer}-ca", tls["secretName"], ca_dir, "ca.crt")
    if not tls["clientAuth"]:
        return TLSFiles(ca=f"{ca_dir}/ca.crt")
    out.secret(f"{peer}-client", tls["engineClientSecret"], client_dir)
    return TLSFiles(f"{ca_dir}/ca.crt", f"{client_dir}/tls.crt", f"{client_dir}/tls.key")


def cachestore_server(spec: RAGServeSpec) -> tuple[Mounts, ServingTLS, str | None]:
    """The cachestore's serving certificate (and client CA for mutual TLS), and its token file, mounted."""
    cs, out, token = spec.cachestore, Mounts(), None
    tls = serving_tls_files(cs["tls"], out)
    if secret := cs["auth"].get("existingSecret"):
        out.secret("auth", secret, CACHESTORE_AUTH_DIR, cs["auth"]["key"])
        token = f"{CACHESTORE_AUTH_DIR}/{cs['auth']['key']}"
    return out, tls, token


def cachestore_client(spec: RAGServeSpec) -> tuple[Mounts, TLSFiles, str | None]:
    """A client's side (engines, and the router's store lookups): CA, client certificate, the token file."""
    cs, out, token = spec.cachestore, Mounts(), None
    if not cs["enabled"]:
        return out, TLSFiles(), token
    tls = client_tls(cs["tls"], "cachestore", out)
    if secret := cs["auth"].get("existingSecret"):
        out.secret("cachestore-token", secret, CACHESTORE_TOKEN_DIR, cs["auth"]["key"])
        token = f"{CACHESTORE_TOKEN_DIR}/{cs['auth']['key']}"
    return out, tls, token


def registry_tls_client(spec: RAGServeSpec) -> tuple[Mounts, TLSFiles]:
    """An engine's side of the router registry's TLS (the chart's router.tls)."""
    out = Mounts()
    return out, client_tls(spec.router["tls"], "router", out)


def registry_token_file(spec: RAGServeSpec) -> str | None:
    """Where router and engines read the registry token (--registry-token-file), when one is set."""
    ref = (spec.router.get("registryAuth") or {}).get("tokenSecret")
    return f"{REGISTRY_TOKEN_DIR}/{ref['key']}" if ref else None


def registry_token(spec: RAGServeSpec) -> Mounts:
    """The registry token's Secret mount (at registry_token_file()), for the router and every engine alike."""
    out = Mounts()
    if registry_token_file(spec):
        ref = spec.router["registryAuth"]["tokenSecret"]
        out.secret("registry-token", ref["name"], REGISTRY_TOKEN_DIR, ref["key"])
    return out
