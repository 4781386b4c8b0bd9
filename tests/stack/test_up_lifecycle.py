"""`ragserve up` lifecycle: --exit-after-demo, SIGKILL of up, a crashing child, bad arguments."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

from ragserve.cli import build_parser
from ragserve.stack.config import StackConfig
from ragserve.stack.spec import Ports, engine_spec
from tests.helpers.process import alive, wait_gone
from tests.helpers.stack import ROOT, Up, run_up, tiny

SMALL = ("--engines", "1", "--redis", "off", "--num-gpu-blocks", "64", "--served-model-name", "tiny")


def test_exit_after_demo_for_scripts(tmp_path):
    """What `make run RUN_ARGS=--exit-after-demo` runs: up, demo, down, the demo's exit code."""
    questions = ["How do I descale the Aurora X2?", "What brew temperature does the Aurora X2 use?"]
    demo_args = " ".join(f"--question '{q}'" for q in questions)
    args = ("--num-gpu-blocks", "512", "--model", tiny(), "--exit-after-demo", "--demo-args", demo_args)
    up = Up(tmp_path, *SMALL, *args)
    try:
        assert up.proc.wait(300) == 0, up.output()[-5000:]
        out = up.output()
        assert "ragserve is up" in out and "demo finished with exit code 0" in out
        assert "repeated context" in out and "prompt tokens served from cache" in out
        assert "embeddings: all-minilm-l6-v2 via /v1/embeddings" in out  # the stack's embedding engine
        up.state = json.loads(up.state_file.read_text())
        assert wait_gone(up.child_pids, timeout=5) == []
    finally:
        up.cleanup()


def test_sigkill_of_up_takes_every_child_down(tmp_path):
    """PR_SET_PDEATHSIG: children die with `ragserve up` even when it cannot clean up."""
    up = Up(tmp_path, *SMALL, "--model", tiny())
    try:
        up.wait_ready()
        pids = up.child_pids
        assert len(pids) == 4 and all(alive(p) for p in pids)  # cachestore, router, engine-0, embed-0
        up.stop(signal.SIGKILL)
        assert wait_gone(pids, timeout=15) == []
    finally:
        up.cleanup()


def test_a_crashed_child_is_reported_and_stops_the_stack(tmp_path):
    up = Up(tmp_path, *SMALL, "--no-cachestore", "--model", tiny())
    try:
        state = up.wait_ready()
        assert set(state["pids"]) == {"router", "engine-0", "embed-0"}
        os.kill(state["pids"]["engine-0"], signal.SIGKILL)
        assert up.proc.wait(60) == 1
        out = up.output()
        assert "engine-0" in out and "exited with code -9" in out
        assert wait_gone(up.child_pids, timeout=5) == []
    finally:
        up.cleanup()


def test_unknown_model_is_a_clear_error():
    proc = run_up("--model", "no-such-model", "--port", "0")
    assert proc.returncode == 2
    assert "unknown model 'no-such-model'" in proc.stderr and "started" not in proc.stdout


def test_busy_port_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = run_up("--model", tiny(), "--port", str(busy.getsockname()[1]))
    assert proc.returncode == 2 and "is in use" in proc.stderr and "--port" in proc.stderr


def test_bad_flag_values_are_rejected():
    proc = run_up("--redis", "localhost:6379", "--port", "0")
    assert proc.returncode == 2 and "--redis must be auto, off or a redis:// URL" in proc.stderr
    proc = run_up("--engines", "0")
    assert proc.returncode == 2 and "must be a positive integer" in proc.stderr


def test_engine_flags_reach_every_engine():
    args = build_parser().parse_args(
        ["up", "--model", "m", "--num-gpu-blocks", "64", "--kv-cache-memory", "1GiB", "--no-enable-prefix-caching",
         "--max-model-len", "2048", "--engine-arg=--seed=7", "--policy", "prefix"]
    )  # fmt: skip
    cfg = StackConfig.from_args(args)
    argv = engine_spec(cfg, Ports(8080, 50051, 50061, 9090, 6379, [8001]), 0).argv
    for flag in (["--num-gpu-blocks", "64"], ["--kv-cache-memory", str(1024**3)], ["--max-model-len", "2048"]):
        assert argv[argv.index(flag[0]) + 1] == flag[1]
    assert "--no-enable-prefix-caching" in argv and "--seed=7" in argv
    assert argv[argv.index("--router") + 1] == "127.0.0.1:50051"
    assert argv[argv.index("--advertise-url") + 1] == "http://127.0.0.1:8001"
    assert "--max-num-seqs" not in argv  # defaults stay the engine's own
    # and the engine CLI accepts the whole command line
    build_parser().parse_args(argv[argv.index("engine") :])


def test_up_demo_cli_and_health_probe_import_no_torch():
    """The health probe runs in the torch-free router image; `ragserve up` and the demo's CLI stay light."""
    code = (
        "import sys, ragserve.stack, ragserve.stack.supervisor, ragserve.stack.health, ragserve.demo; "
        "from ragserve.cli import build_parser; build_parser(); assert 'torch' not in sys.modules, 'torch'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_the_stack_never_gives_two_children_one_port():
    """Ports are picked while all are bound, so a stack cannot start two servers on one port."""
    for _ in range(20):
        p = Ports.pick(StackConfig(engines=8, port=0))
        ports = [p.router_http, p.router_grpc, p.cachestore, p.cachestore_metrics, p.redis, *p.engines]
        assert len(set(ports)) == len(ports) == 13 and all(ports)
