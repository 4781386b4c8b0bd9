"""`ragserve up --tls-ca/--tls-cert/--tls-key`: the TLS material given once reaches every gRPC link of a real
local stack. The router's registry and the cachestore serve mutual TLS (a plaintext client, a client without a
certificate and one signed by another CA are refused), engines register and offload with the certificate, the
router's cachestore lookups carry it; bad TLS flags are refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ragserve.stack.health import grpc_serving
from ragserve.stack.passthrough import parser_for
from tests.helpers.engine_server import LONG_CONTEXT, scrape
from tests.helpers.pki import client_credentials, write_test_pki
from tests.helpers.process import until
from tests.helpers.stack import Up, run_up, tiny


def tls_args(certs: dict[str, Path], **files: str) -> list[str]:
    """--tls-ca/--tls-cert/--tls-key, by default the test PKI's CA and peer certificate (it serves and connects);
    files replaces one, by PKI name (cert="server_cert") or path, or drops it (ca="")."""
    files = {"ca": "ca", "cert": "peer_cert", "key": "peer_key", **files}
    return [a for part, name in files.items() if name for a in (f"--tls-{part}", str(certs.get(name, name)))]


def argv_of(pid: int) -> list[str]:
    """A child's `ragserve <component> ...` arguments, read from the running process."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    return argv[argv.index("ragserve.cli") + 1 :]


def puts(state: dict) -> float:
    return scrape(state["cachestore_metrics"]).get("ragserve_cachestore_puts_total{}", 0)


def test_tls_given_once_secures_the_registry_and_the_cachestore(tmp_path):
    certs = write_test_pki(tmp_path)
    up = Up(tmp_path, "--engines", "1", "--embedding-engines", "0", "--redis", "off", "--num-gpu-blocks", "256",
            "--model", tiny(), "--served-model-name", "tiny", *tls_args(certs))  # fmt: skip
    try:
        state = up.wait_ready()  # the engine registered over mutual TLS, the cachestore probe spoke it too
        chat = {"model": "tiny", "messages": [{"role": "user", "content": LONG_CONTEXT}], "max_tokens": 2}
        resp = httpx.post(state["url"] + "/v1/chat/completions", json=chat, timeout=120)
        assert resp.status_code == 200, resp.text
        until(lambda: puts(state) > 0, what="the engine's Puts over mutual TLS")
        for name in ("registry", "cachestore"):
            address = state[name]
            assert grpc_serving(address, credentials=client_credentials(certs, "peer")), name
            assert not grpc_serving(address), f"{name} answered a plaintext client"
            assert not grpc_serving(address, credentials=client_credentials(certs)), f"{name}: no client certificate"
            rogue = client_credentials(certs, "rogue_client")
            assert not grpc_serving(address, credentials=rogue), f"{name}: a certificate from another CA"
        router = parser_for("router").parse_args(argv_of(state["pids"]["router"])[1:])
        lookups = (router.cachestore_tls_ca, router.cachestore_tls_cert, router.cachestore_tls_key)
        assert lookups == (str(certs["ca"]), str(certs["peer_cert"]), str(certs["peer_key"]))
    finally:
        up.cleanup()


@pytest.mark.parametrize(
    "files, says",
    [
        ({"ca": ""}, "--tls-ca, --tls-cert and --tls-key go together (mutual TLS): missing --tls-ca"),
        ({"key": ""}, "--tls-ca, --tls-cert and --tls-key go together (mutual TLS): missing --tls-key"),
        ({"cert": "no-such.pem"}, "cannot read --tls-cert no-such.pem: [Errno 2] No such file or directory"),
        ({"ca": "README.md"}, "--tls-ca README.md is not a PEM file"),
        ({"cert": "server_cert", "key": "server_key"}, "does not pass mutual TLS with itself on 127.0.0.1"),
        ({"key": "server_key"}, "does not pass mutual TLS with itself on 127.0.0.1"),
        ({"ca": "rogue_ca"}, "does not pass mutual TLS with itself on 127.0.0.1"),
    ],
)
def test_bad_tls_flags_fail_before_anything_starts(tmp_path, files, says):
    """Missing or unreadable files, and a certificate that cannot serve and connect on loopback (server_cert has
    only serverAuth; a key of another certificate; a CA that did not sign it)."""
    certs = write_test_pki(tmp_path)
    proc = run_up("--port", "0", "--model", "no-such-model", *tls_args(certs, **files))  # a started stack fails
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "ragserve up: error: " in proc.stderr and says in proc.stderr, proc.stderr
    assert "started" not in proc.stdout and "Traceback" not in proc.stderr
