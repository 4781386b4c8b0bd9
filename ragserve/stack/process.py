"""Child processes of `ragserve up`: own process group, killed with their parent, logs prefixed.

Each child runs in its own process group (Ctrl-C in the terminal reaches only `ragserve up`,
which then stops the children in order) and, on Linux, gets PR_SET_PDEATHSIG = SIGKILL, so
it dies with `ragserve up` even when that is SIGKILLed and has no chance to clean up.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PR_SET_PDEATHSIG = 1
TAIL_LINES = 40
COLORS = ("36", "33", "35", "32", "34", "31", "96", "93")

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None


def _child_setup(parent_pid: int) -> Callable[[], None]:
    """Runs in the child between fork and exec: new process group, die with the parent."""

    def setup() -> None:
        os.setpgid(0, 0)
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return setup


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    probe: str  # health.check target telling when it is ready
    url: str = ""  # what to print for users
    env: dict[str, str] = field(default_factory=dict)


class LogSink:
    """Prints child output as `name | line`, one whole line at a time, optionally colored."""

    def __init__(self, show: bool = True, stream=None) -> None:
        self.show = show
        self.stream = stream or sys.stdout
        self.color = self.stream.isatty() and not os.environ.get("NO_COLOR")
        self.width = 10
        self._lock = threading.Lock()

    def prefix(self, name: str, index: int) -> str:
        text = f"{name:<{self.width}}|"
        return f"\033[{COLORS[index % len(COLORS)]}m{text}\033[0m" if self.color else text

    def line(self, prefix: str, text: str) -> None:
        if self.show:
            self.say(f"{prefix} {text}")

    def say(self, text: str) -> None:
        with self._lock:
            print(text, file=self.stream, flush=True)


class Child:
    def __init__(self, spec: ChildSpec, sink: LogSink, index: int = 0, capture: bool = True) -> None:
        self.spec = spec
        self.sink = sink
        self.index = index
        self.capture = capture  # False: the child writes straight to our stdout (the demo)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self._pump: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, env: dict[str, str]) -> None:
        """Must be called from the main thread: PDEATHSIG follows the thread that forked."""
        out = subprocess.PIPE if self.capture else None
        self.proc = subprocess.Popen(
            self.spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT if self.capture else None,
            env={**env, **self.spec.env},
            preexec_fn=_child_setup(os.getpid()),  # noqa: PLW1509 (async-signal-safe enough: setpgid + prctl)
            close_fds=True,
        )
        self.started_at = time.monotonic()
        if self.capture:
            self._pump = threading.Thread(target=self._read, name=f"log-{self.name}", daemon=True)
            self._pump.start()

    def _read(self) -> None:
        prefix = self.sink.prefix(self.name, self.index)
        for raw in self.proc.stdout:
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.tail.append(text)
            self.sink.line(prefix, text)

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def signal(self, sig: int) -> None:
        """Signal the child's whole process group (it and anything it started)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        if self._pump is not None:
            self._pump.join(timeout=2)
        return code


def stop_all(children: list[Child], grace: float, say: Callable[[str], None]) -> None:
    """SIGTERM every child's group, wait up to grace seconds in total, SIGKILL what is left."""
    for child in children:
        child.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        if child.wait(max(0.0, deadline - time.monotonic())) is None:
            say(f"{child.name} did not stop within {grace:.0f}s: SIGKILL")
            child.signal(signal.SIGKILL)
            child.wait(5)
