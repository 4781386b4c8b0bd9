"""Readiness probes for the stack's processes, also the containers' HEALTHCHECK command.

    python -m ragserve.stack.health http://127.0.0.1:8000/ready    # HTTP 200
    python -m ragserve.stack.health grpc://127.0.0.1:50061          # grpc.health.v1 SERVING
    python -m ragserve.stack.health redis://127.0.0.1:6379          # PING -> PONG

Exit status 0 when healthy, 1 otherwise. Torch-free and cheap to import.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import urllib.error
import urllib.request
from urllib.parse import urlsplit

TIMEOUT_S = 2.0


def http_get(url: str, timeout: float = TIMEOUT_S) -> tuple[int, dict]:
    """(status, JSON body or {}) of a GET; status 0 when the server cannot be reached."""
    status, raw = 0, b""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback URLs we built)
            status = resp.status
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        status = exc.code
        with contextlib.suppress(OSError):
            raw = exc.read()
    except (OSError, ValueError):  # unreachable, or too slow to answer
        pass
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        body = {}
    return status, body if isinstance(body, dict) else {}


def grpc_serving(address: str, timeout: float = TIMEOUT_S, credentials=None) -> bool:
    """The grpc.health.v1 overall status is SERVING; `credentials` (grpc.ChannelCredentials) for a TLS server."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def mutual_tls_with_itself(ca: str, cert: str, key: str, timeout: float = TIMEOUT_S) -> bool:
    """A throwaway health server on 127.0.0.1 serving cert/key and requiring client certificates signed by ca,
    probed with the same files: what `ragserve up --tls-*` needs of them (ca signs cert, key matches, the SAN
    covers 127.0.0.1, key usage allows serving and connecting)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from ragserve.tls import channel_credentials, server_credentials

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    try:
        port = server.add_secure_port("127.0.0.1:0", server_credentials(cert, key, ca))
    except RuntimeError:  # a key that does not fit the certificate, or no PEM grpc can use
        port = 0
    if not port:
        return False
    server.start()
    try:
        return grpc_serving(f"127.0.0.1:{port}", timeout, channel_credentials(ca, cert, key))
    finally:
        server.stop(None)


def redis_pong(host: str, port: int, timeout: float = TIMEOUT_S) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def check(target: str, timeout: float = TIMEOUT_S, credentials=None) -> bool:
    """True when the server behind target (http(s)://, grpc://HOST:PORT, redis://HOST:PORT) is healthy;
    `credentials` (grpc.ChannelCredentials) for a gRPC server that speaks TLS."""
    parts = urlsplit(target)
    if parts.scheme in ("http", "https"):
        return http_get(target, timeout)[0] == 200
    if parts.scheme == "grpc":
        return grpc_serving(parts.netloc, timeout, credentials)
    if parts.scheme == "redis":
        return redis_pong(parts.hostname or "127.0.0.1", parts.port or 6379, timeout)
    raise ValueError(f"unsupported probe target {target!r}: use http://, grpc:// or redis://")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ragserve.stack.health http://HOST:PORT/PATH | grpc://HOST:PORT | redis://HOST:PORT")
        return 2
    try:
        healthy = check(argv[0])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print("healthy" if healthy else f"unhealthy: {argv[0]}")
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
