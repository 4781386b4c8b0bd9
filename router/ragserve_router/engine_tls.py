"""How the router's HTTP clients reach https:// engines: verified against --engine-ca-file (else the system
roots), presenting --engine-client-cert-file and -key-file to engines that require client certificates."""

from __future__ import annotations

import ssl

from ragserve.router_args import RouterConfig
from ragserve.tls import client_ssl


def engine_verify(cfg: RouterConfig) -> ssl.SSLContext | bool:
    """httpx's `verify` for engine clients (True: httpx's default, the system roots, no client certificate)."""
    if not (cfg.engine_ca_file or cfg.engine_client_cert_file):
        return True
    flags = "--engine-ca-file / --engine-client-cert-file / --engine-client-key-file"
    return client_ssl(cfg.engine_ca_file, cfg.engine_client_cert_file, cfg.engine_client_key_file, flags)
