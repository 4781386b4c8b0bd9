"""`ragserve operator` as users run it."""

from __future__ import annotations

import os
import subprocess
import sys

from ragserve.cli import build_parser


def operator(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ragserve.cli", "operator", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_the_flags():
    out = operator("--help")
    assert out.returncode == 0
    for flag in (
        "--namespace",
        "--all-namespaces",
        "--liveness",
        "--kubeconfig",
        "--peering",
        "--print-crd",
        "--metrics-address",
        "--retry-delay",
    ):
        assert flag in out.stdout


def test_scope_must_be_chosen():
    out = operator()
    assert out.returncode == 2
    assert "choose either --namespace NS[,NS...] or --all-namespaces" in out.stderr
    out = operator("--namespace", "a", "--all-namespaces")
    assert out.returncode == 2 and "choose either" in out.stderr


def test_retry_delay_must_be_positive():
    out = operator("--all-namespaces", "--retry-delay", "0", "--liveness", "")
    assert out.returncode == 2 and "--retry-delay must be positive" in out.stderr


def test_flags_read_the_environment(monkeypatch):
    monkeypatch.setenv("RAGSERVE_NAMESPACE", "team-a,team-b")
    monkeypatch.setenv("RAGSERVE_LIVENESS", "")
    args = build_parser().parse_args(["operator"])
    assert (args.namespace, args.liveness, args.all_namespaces) == ("team-a,team-b", "", False)


def test_unreadable_kubeconfig_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.yaml"
    out = operator("--all-namespaces", "--kubeconfig", str(missing), "--liveness", "")
    assert out.returncode == 2
    assert f"kubeconfig {missing} does not exist" in out.stderr


def test_no_cluster_is_a_clear_error(tmp_path):
    env = {"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "absent"), "KUBERNETES_SERVICE_HOST": ""}
    out = operator("--all-namespaces", "--liveness", "", env=env)
    assert out.returncode == 2
    assert "no Kubernetes API to talk to" in out.stderr


def test_operator_is_torch_free():
    """It ships in the torch-free image with the router and cachestore."""
    code = (
        "import sys; import ragserve_operator.handlers, ragserve_operator.cli; "
        "from ragserve.cli import build_parser; build_parser(); assert 'torch' not in sys.modules, 'torch'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
