"""Compiles in this process, for the load tracker: a step that compiled (seconds of inductor work, once) says
nothing about the engine's speed, and neither does a step that ran beside a compile on another thread (a
server compiles decode graphs in the background: inductor takes the CPU the step would have had). Such steps
are left out of the speeds; the start-up calibration's measurements stand meanwhile."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

COMPILE_THREAD = "ragserve-decode-compile"  # the thread compilation.decode_graphs compiles on in the background
_lock = threading.Lock()
_in_flight = 0  # compiles running now, all threads
_epoch = 0  # compiles started or finished so far, all threads


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Wraps a compile; bumps the process's epoch when it starts and when it ends."""
    global _in_flight, _epoch
    with _lock:
        _in_flight, _epoch = _in_flight + 1, _epoch + 1
    try:
        yield
    finally:
        with _lock:
            _in_flight, _epoch = _in_flight - 1, _epoch + 1


def compile_epoch() -> int:
    return _epoch


def quiet_since(epoch: int) -> bool:
    """No compile ran in this process, on any thread, since compile_epoch() returned epoch."""
    with _lock:
        return _in_flight == 0 and _epoch == epoch
