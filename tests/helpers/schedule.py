"""xdist's units of work: a test module, or one of WHOLE_DIRECTORIES whole (they share session fixtures), or the
modules that share one session engine (SHARED_MODULES)."""

from __future__ import annotations

# Directories whose tests share session fixtures (a Redis, a router fleet, rendered charts) or, for the
# operator's, whose last test checks what all of them called: one xdist worker runs each whole.
WHOLE_DIRECTORIES = {"cachestore", "charts", "operator", "router"}
# Modules that share one session fixture (tests/engine/conftest.py's smollm2_engine): one unit of work.
SHARED_MODULES = {
    f"tests/engine/{m}.py": "tests/engine:smollm2"
    for m in ("test_structured_outputs", "test_tool_calls", "test_llm_rerank")
}


def unit_of(nodeid: str) -> str:
    """`tests/router/test_x.py::test_y` -> `tests/router`; `tests/engine/test_x.py::test_y` -> that file."""
    path = nodeid.split("::", 1)[0]
    if path in SHARED_MODULES:
        return SHARED_MODULES[path]
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 and parts[1] in WHOLE_DIRECTORIES else path
