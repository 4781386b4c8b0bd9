"""The Triton kernels on CPU through Triton's interpreter, scoped to the modules that test them.

Triton reads TRITON_INTERPRET twice: when @triton.jit decorates a kernel (import time: an interpreted kernel is
an InterpretedFunction) and while a kernel runs (constexpr functions). So a kernel-testing module imports the
kernels inside `interpreted_import()` and its tests use the `triton_interpret` fixture (tests/conftest.py);
the variable is never left in os.environ for later tests or the processes they start. For example:

    with interpreted_import():
        from ragserve_engine.attention.triton_backend import TritonAttentionBackend
    pytestmark = pytest.mark.usefixtures("triton_interpret")
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

VAR = "TRITON_INTERPRET"


@contextmanager
def interpreted_import() -> Iterator[None]:
    """TRITON_INTERPRET=1 while the block imports the kernels, restored after; fails if they were compiled."""
    before = os.environ.get(VAR)
    os.environ[VAR] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[VAR]
        else:
            os.environ[VAR] = before
    from ragserve_engine.attention.triton_utils import kernels_interpreted

    assert kernels_interpreted(), "the Triton kernels were imported before TRITON_INTERPRET=1 was set"
