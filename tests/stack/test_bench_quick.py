"""bench/rag_cluster.py --quick: every configuration completes through the full stack and reports
well-formed numbers. The ratios are the benchmark's business, not this test's."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys

import pytest

from tests.helpers.stack import ROOT, stack_env

# The baseline, the full stack (kv_aware's prediction header, the cachestore) and kv_aware with the engines
# external (vLLM KV events, no registration); prefix and kv_aware alone run the same code paths between these
# and are left to the benchmark itself.
CONFIGS = ["round_robin", "kv_aware+cachestore", "kv_aware+external"]


def run_group(argv: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """Run the benchmark in its own session; past the timeout kill the whole group (its stack's engines, router
    and cachestore too, which would otherwise hold the test's pipes open and hang it) and fail with its output."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"benchmark still running after {timeout} s, its process group killed:\n{output[-10000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing it started outlives it
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, output


@pytest.mark.slow
def test_quick_cluster_benchmark(tmp_path):
    env = stack_env(all_cores=False)  # the run's share of the cores, as the engines it starts get
    cmd = [sys.executable, str(ROOT / "bench" / "rag_cluster.py"), "--quick", "--requests", "12", "--clients", "3"]
    cmd += ["--engines", "2", "--configs", ",".join(CONFIGS), "--enforce-eager"]  # compiled decode: own tests
    returncode, output = run_group([*cmd, "--out", str(tmp_path)], env, timeout=900)
    assert returncode == 0, output[-10000:]
    report = json.loads((tmp_path / "rag_cluster-quick.json").read_text())
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == CONFIGS
    for name, r in results.items():
        assert r["requests"] == 12 and r["errors"] == 0, name
        assert r["prompt_tokens"] > 12 * 1000 and r["usage_prompt_tokens"] == r["prompt_tokens"], name
        assert r["computed"] == r["prompt_tokens"] - r["local"] - r["fetched"] >= 0  # never more cached than sent
        # the engines' cache counters (Prometheus) agree with the cached_tokens the clients were told (usage)
        assert r["local"] + r["fetched"] == r["usage_cached_tokens"], name
        assert 0.0 <= r["cached_share_after_first"] <= 1.0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] and r["requests_per_s"] > 0 and r["wall_s"] > 0
        assert all(math.isfinite(v) and v > 0 for k, v in r["ratios"].items() if k != "computed_tokens")
        rows = r["per_request"]  # per-request records, in send order, for finding what makes the tail
        assert len(rows) == 12 and all(x["ok"] and x["engine"] and x["ttft_s"] > 0 for x in rows), name
        assert [x["sent_s"] for x in rows] == sorted(x["sent_s"] for x in rows)
        assert all(x["reason"] for x in rows) and 0 < r["first_sight"] < 12  # the router's reason, per request
        predicted = [x["predicted_ttft_s"] for x in rows]  # kv_aware's prediction (router header), only there
        expected_none = not name.startswith("kv_aware")
        assert all((p is None) == expected_none and (p is None or p >= 0) for p in predicted), name
    external = results["kv_aware+external"]  # the router followed the engines' vLLM events: its index filled
    assert external["engines"].startswith("external") and external["cachestore"] == "none"
    assert set(external["engine_shares"]) == {"external-0", "external-1"} and external["router_kv_stored"] > 0
    assert results["round_robin"]["ratios"]["ttft_p50_speedup"] == 1.0
    assert results["round_robin"]["fetched"] == 0  # no cachestore, nothing fetched
    table = (tmp_path / "rag_cluster-quick.md").read_text()
    assert all(f"| {name} |" in table for name in CONFIGS)
    for plot in ("tokens", "ttft"):
        assert (tmp_path / f"rag_cluster-quick_{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
