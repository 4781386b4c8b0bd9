"""`ragserve cachestore` as users run it: flags, environment, errors, and a real process with TLS, mTLS and a token."""

import os
import socket
import subprocess
import sys

import httpx
import pytest

from ragserve.cli import build_parser
from ragserve_cachestore.client import CacheStoreClient, TLSConfig
from tests.helpers.cachestore import LAYOUT, kv_blocks
from tests.helpers.net import free_port
from tests.helpers.pki import client_credentials

FLAGS = (
    "--host --port --memory --disk-dir --disk --redis --tls-cert --tls-key --tls-client-ca --auth-token-file",
    "--max-message-bytes --metrics-port --max-blocks-per-call --redis-capacity",
)


def ragserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ragserve.cli", "cachestore", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_flags_match_the_contract_and_read_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("RAGSERVE_MEMORY", "1GiB")
    monkeypatch.setenv("RAGSERVE_MAX_MESSAGE_BYTES", "8MiB")
    parser = build_parser()
    args = parser.parse_args(["cachestore"])
    assert (args.port, args.metrics_port, args.memory, args.max_message_bytes) == (50061, 9090, 1024**3, 8 * 1024**2)
    assert args.disk == 50 * 1024**3 and args.disk_dir is None and args.redis is None
    with pytest.raises(SystemExit):
        parser.parse_args(["cachestore", "--help"])
    help_text = capsys.readouterr().out
    for flag in " ".join(FLAGS).split():
        assert flag in help_text, flag


def test_bad_settings_exit_nonzero_with_a_message():
    half_tls = ragserve("--tls-cert", "server.crt")
    assert half_tls.returncode == 2 and "--tls-cert and --tls-key go together" in half_tls.stderr
    bad_size = ragserve("--memory", "lots")
    assert bad_size.returncode == 2 and "invalid size 'lots'" in bad_size.stderr
    assert "Traceback" not in half_tls.stderr + bad_size.stderr


def test_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        out = ragserve("--host", "127.0.0.1", "--port", str(taken.getsockname()[1]), "--metrics-port", "0")
    assert out.returncode == 2 and "cannot listen on 127.0.0.1:" in out.stderr and "Traceback" not in out.stderr


def test_process_with_mutual_tls_token_and_metrics(cachestore_process, certs, tmp_path):
    token = tmp_path / "token"
    token.write_text("process-token")
    metrics_port = free_port()
    env = dict(os.environ, RAGSERVE_AUTH_TOKEN_FILE=str(token))  # one setting from the environment
    proc = cachestore_process(
        *("--tls-cert", str(certs["server_cert"]), "--tls-key", str(certs["server_key"])),
        *("--tls-client-ca", str(certs["ca"]), "--metrics-port", str(metrics_port), "--memory", "16MiB"),
        env=env,
        wait=False,
    )
    tls = TLSConfig(str(certs["ca"]), str(certs["client_cert"]), str(certs["client_key"]))
    proc.wait_serving(client_credentials(certs, client="client"))
    blocks = kv_blocks(32, 8192)
    with CacheStoreClient([proc.address], LAYOUT, tls=tls, token="process-token") as client:
        assert client.put(blocks) == 32
        assert client.get([b.key for b in blocks]) == blocks
    with CacheStoreClient([proc.address], LAYOUT, tls=tls) as anonymous:
        assert anonymous.lookup([b.key for b in blocks]) == 0  # no token: refused, reported as a miss
    metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    assert "ragserve_cachestore_puts_total 32.0" in metrics
    assert 'ragserve_cachestore_capacity_bytes{tier="memory"} 1.6777216e+07' in metrics
    assert proc.stop() == 0  # SIGTERM: a clean exit


def test_cachestore_never_imports_torch():
    code = (
        "import sys, ragserve_cachestore.cli, ragserve_cachestore.server, ragserve_cachestore.client, "
        "ragserve_cachestore.tiers.redis_tier, ragserve_cachestore.metrics; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
