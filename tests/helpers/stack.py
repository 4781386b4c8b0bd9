"""Helpers: `ragserve up` as a real subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers.process import alive, start, until
from tests.helpers.threads import without_shared_threads

ROOT = Path(__file__).resolve().parents[2]


# What the test run sets that `ragserve up` and its children keep: the run's caches, and eager engines
# (conftest.py; up reads it as its own --enforce-eager default and passes the flag to its engines).
KEPT = ("RAGSERVE_CACHE_DIR", "RAGSERVE_ENFORCE_EAGER")


def stack_env(all_cores: bool = True) -> dict[str, str]:
    """This environment for a `ragserve` stack command, as a user's: no RAGSERVE_* but KEPT; all the cores, or
    this xdist worker's share of them."""
    env = without_shared_threads(dict(os.environ)) if all_cores else dict(os.environ)
    return {k: v for k, v in env.items() if not k.startswith("RAGSERVE_") or k in KEPT}


class Up:
    """One `ragserve up` process; its own session so that signals reach only what the test sends. It divides
    the cores among its engines itself (the run's OMP_NUM_THREADS only where the user set it)."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.state_file = tmp / "state.json"
        env = stack_env()
        argv = [sys.executable, "-m", "ragserve.cli", "up", "--port", "0", "--state-file", str(self.state_file)]
        self.process = start("ragserve up", [*argv, *args], tmp / "up.log", env=env, cwd=ROOT, new_session=True)
        self.proc = self.process.popen
        self.state: dict = {}

    def output(self) -> str:
        return self.process.output()

    def wait_ready(self, timeout: float = 180.0) -> dict:
        """Until up writes its state file (every child started and healthy)."""
        try:
            until(self._state_written, timeout=timeout, interval=0.1, what="the state file", proc=self.process)
        except AssertionError:
            self.stop(signal.SIGKILL)
            raise
        self.state = json.loads(self.state_file.read_text())
        return self.state

    def _state_written(self) -> bool:
        return self.state_file.is_file() and self.state_file.stat().st_size > 0

    @property
    def child_pids(self) -> list[int]:
        return list(self.state.get("pids", {}).values())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        return self.process.stop(sig, timeout)

    def cleanup(self) -> None:
        """Never leak: stop up, then anything it left (the tests assert there is nothing)."""
        self.stop(signal.SIGTERM, 60)
        for pid in self.child_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def run_up(*args: str) -> subprocess.CompletedProcess:
    """`ragserve up` to completion (for arguments it refuses), in stack_env()."""
    env = stack_env()
    cmd = [sys.executable, "-m", "ragserve.cli", "up", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def tiny() -> str:
    from tests.helpers.tiny_models import tiny_model

    return str(tiny_model("llama"))
