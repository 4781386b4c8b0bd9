"""The order xdist hands units of work to its workers: longest first (LPT), from the seconds each unit took.

A unit is a test module, or one of WHOLE_DIRECTORIES whole (they share session fixtures). xdist's own order
(most tests first) put the slow modules with few tests, a SmolLM2 parity or a whole stack, at the end of the
run, where one worker finished them alone. `python -m tests.helpers.schedule REPORT.xml` refreshes
tests/unit_seconds.json from a run's junit report (`make test PYTEST_ARGS=--junitxml=REPORT.xml`).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

SECONDS_FILE = Path(__file__).resolve().parent.parent / "unit_seconds.json"
# Directories whose tests share session fixtures (a Redis, a router fleet, rendered charts) or, for the
# operator's, whose last test checks what all of them called: one xdist worker runs each whole.
WHOLE_DIRECTORIES = {"cachestore", "charts", "operator", "router"}
# Modules that share one session fixture (tests/engine/conftest.py's smollm2_engine): one unit of work.
SHARED_MODULES = {
    f"tests/engine/{m}.py": "tests/engine:smollm2"
    for m in ("test_structured_outputs", "test_tool_calls", "test_llm_rerank")
}
UNKNOWN_UNIT_SECONDS = 10.0  # a module new since the file was written


def unit_of(nodeid: str) -> str:
    """`tests/router/test_x.py::test_y` -> `tests/router`; `tests/engine/test_x.py::test_y` -> that file."""
    path = nodeid.split("::", 1)[0]
    if path in SHARED_MODULES:
        return SHARED_MODULES[path]
    parts = path.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 and parts[1] in WHOLE_DIRECTORIES else path


def unit_seconds() -> dict[str, float]:
    return json.loads(SECONDS_FILE.read_text()) if SECONDS_FILE.exists() else {}


def longest_first(nodeids: list[str]) -> list[int]:
    """Indices of `nodeids` reordered unit by unit, slowest unit first; order within a unit unchanged."""
    seconds = unit_seconds()
    units: dict[str, list[int]] = {}
    for k, nodeid in enumerate(nodeids):
        units.setdefault(unit_of(nodeid), []).append(k)
    ranked = sorted(units, key=lambda u: -seconds.get(u, UNKNOWN_UNIT_SECONDS))  # stable: ties keep file order
    return [k for u in ranked for k in units[u]]


def seconds_from_junit(report: Path) -> dict[str, float]:
    totals: Counter[str] = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.engine.test_x[.TestClass]
        module = "/".join(parts[: next((k for k, p in enumerate(parts) if p.startswith("test_")), len(parts)) + 1])
        totals[unit_of(f"{module}.py::x")] += float(case.get("time") or 0.0)
    return {unit: round(s, 1) for unit, s in sorted(totals.items())}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.helpers.schedule REPORT.xml")
    SECONDS_FILE.write_text(json.dumps(seconds_from_junit(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {SECONDS_FILE}")
