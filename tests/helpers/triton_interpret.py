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
import sys
from collections.abc import Iterator
from contextlib import contextmanager

VAR = "TRITON_INTERPRET"


@contextmanager
def _variable_set() -> Iterator[None]:
    before = os.environ.get(VAR)
    os.environ[VAR] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[VAR]
        else:
            os.environ[VAR] = before


@contextmanager
def interpreted_import() -> Iterator[None]:
    """TRITON_INTERPRET=1 while the block imports the kernels, restored after; fails if they were compiled."""
    with _variable_set():
        yield
    from ragserve_engine.attention.triton_utils import kernels_interpreted

    assert kernels_interpreted(), "the Triton kernels were imported before TRITON_INTERPRET=1 was set"


def interpret_triton_language() -> None:
    """Import Triton itself under TRITON_INTERPRET=1, once per test process, before anything else can.

    triton.language's own helpers (tl.sum, tl.max, cdiv: @triton.jit functions in triton/language/standard.py)
    are decorated when triton is first imported. Imported without the variable (torch's inductor imports triton
    whenever an in-process engine compiles or sets its cache), they are compiled functions, and an interpreted
    kernel calling one fails with "Cannot call @triton.jit'd outside of the scope of a kernel": the kernel
    tests then depended on which test module a worker ran before them. Processes the tests start are unaffected.
    """
    if "triton" in sys.modules:
        return
    try:
        with _variable_set():
            import triton.language  # noqa: F401
    except ImportError:  # no triton installed: nothing to interpret
        pass
