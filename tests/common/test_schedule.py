"""The xdist units of work: whole directories and modules sharing a session engine stay one unit."""

from __future__ import annotations

from tests.helpers import schedule


def test_units_are_modules_or_whole_directories():
    assert schedule.unit_of("tests/router/test_disagg.py::test_x[a-b]") == "tests/router"
    assert schedule.unit_of("tests/engine/test_parity.py::test_y") == "tests/engine/test_parity.py"
    assert schedule.unit_of("tests/engine/test_tool_calls.py::t") == schedule.unit_of(
        "tests/engine/test_structured_outputs.py::t"
    )
