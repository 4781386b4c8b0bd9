"""`ragserve router` flags, environment defaults, start-up errors, and the torch-free promise."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ragserve.cli import build_parser

CONTRACT_FLAGS = (
    "--host 0.0.0.0 --port 8080 --grpc-port 50051 --policy kv_aware --redis redis://redis:6379/0 "
    "--static-engines http://a:8000,http://b:8000/ --k8s-selector app=ragserve-engine --k8s-namespace ns "
    "--api-keys-file /keys --max-body-bytes 2MiB --tls-cert /c --tls-key /k --tls-client-ca /ca"
)
CONTRACT = CONTRACT_FLAGS.split()


def ragserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    argv = [sys.executable, "-m", "ragserve.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=60)


def test_contract_flags_parse():
    args = build_parser().parse_args(["router", *CONTRACT])
    assert args.static_engines == ["http://a:8000", "http://b:8000"]
    assert args.max_body_bytes == 2 * 1024**2
    assert (args.k8s_selector, args.k8s_namespace, args.grpc_port) == ("app=ragserve-engine", "ns", 50051)
    assert (args.tls_cert, args.tls_key, args.tls_client_ca, args.api_keys_file) == ("/c", "/k", "/ca", "/keys")


def test_every_flag_reads_its_environment_variable(monkeypatch):
    monkeypatch.setenv("RAGSERVE_POLICY", "prefix")
    monkeypatch.setenv("RAGSERVE_STATIC_ENGINES", "http://x:1,http://y:2")
    monkeypatch.setenv("RAGSERVE_GRPC_PORT", "6000")
    monkeypatch.setenv("RAGSERVE_ALLOW_POLICY_HEADER", "true")
    monkeypatch.setenv("RAGSERVE_MAX_BODY_BYTES", "1MiB")
    args = build_parser().parse_args(["router"])
    assert args.policy == "prefix" and args.static_engines == ["http://x:1", "http://y:2"]
    assert args.grpc_port == 6000 and args.allow_policy_header and args.max_body_bytes == 1024**2
    assert build_parser().parse_args(["router", "--policy", "session"]).policy == "session"  # flag wins


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policy", "random"], "invalid choice: 'random'"),
        (["--static-engines", "ftp://x"], "engine URL must start with http:// or https://"),
        (["--max-body-bytes", "lots"], "invalid size 'lots'"),
        (["--tls-cert", "/etc/hostname"], "--tls-cert and --tls-key must be given together"),
        (["--api-keys-file", "/no/such/keys"], "no such file: /no/such/keys"),
        (["--redis", "localhost:6379"], "--redis must be a URL"),
        (["--critical-reserve-per-engine", "2"], "--critical-reserve-per-engine must be below --max-inflight"),
        (
            ["--critical-reserve-per-engine", "4", "--max-inflight-per-engine", "4"],
            "--critical-reserve-per-engine must be below --max-inflight",
        ),
    ],
)
def test_bad_flags_are_clear_errors(flags, message):
    out = ragserve("router", *flags)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr


def test_bad_api_keys_file_names_the_line(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-good\nsk-other rps=fast\n")
    out = ragserve("router", "--api-keys-file", str(keys), "--port", "0", "--grpc-port", "0")
    assert out.returncode == 2 and f"{keys}:2: bad option 'rps=fast'" in out.stderr


def test_router_never_imports_torch():
    code = (
        "import sys, pkgutil, importlib, ragserve_router as r\n"
        "for m in pkgutil.iter_modules(r.__path__): importlib.import_module('ragserve_router.' + m.name)\n"
        "from ragserve.cli import build_parser; build_parser()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers imported'\n"
        "print(len(list(pkgutil.iter_modules(r.__path__))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 15
