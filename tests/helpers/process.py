"""Processes started by tests: output to a log file, readiness waits that fail with the log's tail, stop and reap.
Probes are ragserve.stack.health's (the ones `ragserve up` and the images' HEALTHCHECK use). For example:

    proc = start("router", [sys.executable, "-m", "ragserve.cli", "router", ...], tmp / "router.log")
    wait_http("http://127.0.0.1:8000/health", proc=proc)  # fails with the log's tail if the router exits
    proc.stop()  # SIGTERM, SIGKILL after the timeout; always reaped
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from ragserve.stack import health
from ragserve.stack.spec import redis_spec
from tests.helpers.net import free_port

TAIL = 6000  # characters of a log quoted when a process fails to start


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Send `sig` if still running, wait `timeout`, then SIGKILL; returns the exit code."""
        self.terminate(sig)
        return self.reap(timeout)

    def terminate(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` if still running."""
        if self.alive():
            self.popen.send_signal(sig)

    def reap(self, timeout: float = 15.0) -> int:
        """Wait `timeout` for the process to exit (after a signal), then SIGKILL; returns the exit code."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
        return self.popen.wait(10)

    async def stop_async(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """stop() without blocking the event loop (for servers the test runs in the same loop)."""
        if self.alive():
            self.popen.send_signal(sig)
            await until_async(lambda: not self.alive(), timeout=timeout, interval=0.05, fail=False)
        if self.alive():
            self.popen.kill()
        return self.popen.wait(10)

    def failure(self, what: str) -> str:
        state = f"exited with {self.popen.returncode}" if not self.alive() else what
        return f"{self.name} {state}:\n{self.output()[-TAIL:]}"


@contextlib.contextmanager
def frozen(procs: Sequence[Proc]) -> Iterator[None]:
    """SIGSTOP the processes for the block, SIGCONT after: what they report and answer stays as it was."""
    stopped = []
    try:
        for proc in procs:
            proc.popen.send_signal(signal.SIGSTOP)
            stopped.append(proc)
        yield
    finally:
        for proc in stopped:
            proc.popen.send_signal(signal.SIGCONT)


def start(
    name: str,
    argv: list[str],
    log: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    new_session: bool = False,
) -> Proc:
    """Popen with stdout and stderr appended to `log`; `new_session` keeps the terminal's signals away from it."""
    with log.open("ab") as out:
        popen = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=new_session
        )
    return Proc(name, popen, log)


def until(
    check: Callable,
    *,
    timeout: float = 30.0,
    interval: float = 0.1,
    what: str = "condition",
    proc: Proc | None = None,
    fail: bool = True,
):
    """Poll check() until truthy and return its value; fail (AssertionError) after `timeout` or once `proc` has
    exited, quoting its log. With fail=False, return the last falsy value instead."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and not proc.alive():
            raise AssertionError(proc.failure(what))
        value = check()
        if value or time.monotonic() > deadline:
            break
        time.sleep(interval)
    if value or not fail:
        return value
    raise AssertionError(proc.failure(f"not ready: {what}") if proc else f"timed out after {timeout}s: {what}")


async def until_async(
    check: Callable, *, timeout: float = 30.0, interval: float = 0.2, what: str = "condition", fail: bool = True
):
    """until() for asyncio tests: check() may be sync or async, and the loop keeps running meanwhile."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value or loop.time() > deadline:
            break
        await asyncio.sleep(interval)
    if value or not fail:
        return value
    raise AssertionError(f"timed out after {timeout}s: {what}")


def wait_http(url: str, *, proc: Proc | None = None, timeout: float = 60.0) -> None:
    """Until GET `url` answers 200."""
    until(lambda: health.check(url), timeout=timeout, interval=0.05, what=f"GET {url}", proc=proc)


def wait_grpc(
    address: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    proc: Proc | None = None,
    timeout: float = 30.0,
) -> None:
    """Until the gRPC health service at `address` reports SERVING."""
    serving = functools.partial(health.grpc_serving, address, credentials=credentials)
    until(serving, timeout=timeout, what=f"gRPC health at {address}", proc=proc)


def start_redis(tmp: Path) -> tuple[Proc, str]:
    """A throwaway redis-server on a free loopback port, no persistence: (process, URL of database 0)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed: `apt-get install redis-server` (.ci/run does)")
    port = free_port()
    data = tmp / f"redis-{port}"
    data.mkdir()
    spec = redis_spec(exe, port, str(data), "warning")  # as `ragserve up` runs it
    proc = start("redis", spec.argv, tmp / f"redis-{port}.log")
    until(lambda: health.check(spec.probe), timeout=20, interval=0.05, what="redis PING", proc=proc)
    return proc, spec.url


def alive(pid: int) -> bool:
    """True if pid runs (zombies count as gone: they have exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Wait for processes this test did not start; returns those still running after `timeout`."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
