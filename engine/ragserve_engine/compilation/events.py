"""Compiles in this process, for the load tracker: a step that compiled (seconds of inductor work, once) or
ran beside a background compile says nothing about the engine's speed, so its duration is left out."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_state = {"epoch": 0, "active": 0}


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Wraps a compile (on any thread)."""
    with _lock:
        _state["epoch"] += 1
        _state["active"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["active"] -= 1
            _state["epoch"] += 1


def compile_epoch() -> int:
    return _state["epoch"]


def quiet_since(epoch: int) -> bool:
    """No compile started, ran or ended since compile_epoch() returned epoch."""
    return _state["epoch"] == epoch and _state["active"] == 0
