"""Helpers: `ragserve up` as a real subprocess, and process liveness by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    """True if pid runs (zombies count as gone: they have exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


class Up:
    """One `ragserve up` process; its own session so that signals reach only what the test sends."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.state_file = tmp / "state.json"
        self.log_file = tmp / "up.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAGSERVE_")}
        argv = [sys.executable, "-m", "ragserve.cli", "up", "--port", "0", "--state-file", str(self.state_file)]
        with self.log_file.open("wb") as log:
            self.proc = subprocess.Popen(
                [*argv, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        self.state: dict = {}

    def output(self) -> str:
        return self.log_file.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"ragserve up exited with {self.proc.returncode}:\n{self.output()[-6000:]}")
            if self.state_file.is_file() and self.state_file.stat().st_size:
                self.state = json.loads(self.state_file.read_text())
                return self.state
            time.sleep(0.3)
        self.stop(signal.SIGKILL)
        pytest.fail(f"ragserve up not ready after {timeout}s:\n{self.output()[-6000:]}")

    @property
    def child_pids(self) -> list[int]:
        return list(self.state.get("pids", {}).values())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def cleanup(self) -> None:
        """Never leak: stop up, then anything it left (the tests assert there is nothing)."""
        self.stop(signal.SIGTERM, 60)
        for pid in self.child_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def tiny() -> str:
    from tests.helpers.tiny_models import tiny_model

    return str(tiny_model("llama"))
