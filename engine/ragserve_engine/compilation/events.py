"""Compiles on this thread, for the load tracker: a step that compiled (seconds of inductor work, once)
says nothing about the engine's speed, so its duration is left out. Per thread: a server compiles decode
graphs on a thread of its own, and the steps beside it are real (if slower) samples."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_local = threading.local()


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Wraps a compile; marks this thread's epoch before and after it."""
    _local.epoch = compile_epoch() + 1
    try:
        yield
    finally:
        _local.epoch += 1


def compile_epoch() -> int:
    return getattr(_local, "epoch", 0)


def quiet_since(epoch: int) -> bool:
    """No compile ran on this thread since compile_epoch() returned epoch."""
    return compile_epoch() == epoch
