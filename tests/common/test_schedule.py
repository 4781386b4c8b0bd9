"""The xdist work order: whole directories stay one unit, slow units go out first."""

from __future__ import annotations

from tests.helpers import schedule


def test_units_are_modules_or_whole_directories():
    assert schedule.unit_of("tests/router/test_disagg.py::test_x[a-b]") == "tests/router"
    assert schedule.unit_of("tests/engine/test_parity.py::test_y") == "tests/engine/test_parity.py"
    assert schedule.unit_of("tests/engine/test_tool_calls.py::t") == schedule.unit_of(
        "tests/engine/test_structured_outputs.py::t"
    )


def test_longest_unit_first_and_each_unit_kept_together(monkeypatch):
    seconds = {"tests/engine/test_b.py": 50.0, "tests/router": 90.0, "tests/engine/test_a.py": 1.0}
    monkeypatch.setattr(schedule, "unit_seconds", lambda: seconds)
    ids = ["tests/engine/test_a.py::t1", "tests/engine/test_b.py::t1", "tests/router/test_r.py::t1",
           "tests/engine/test_new.py::t1", "tests/engine/test_b.py::t2", "tests/router/test_s.py::t1"]  # fmt: skip
    order = [ids[k] for k in schedule.longest_first(ids)]
    want = ["tests/router/test_r.py::t1", "tests/router/test_s.py::t1", "tests/engine/test_b.py::t1",
            "tests/engine/test_b.py::t2", "tests/engine/test_new.py::t1", "tests/engine/test_a.py::t1"]  # fmt: skip
    assert order == want


def test_the_committed_seconds_name_existing_units():
    root = schedule.SECONDS_FILE.parent.parent
    seconds = schedule.unit_seconds()
    assert seconds["tests/router"] > 60.0  # a real run's figures, not an empty file
    stale = [u for u in seconds if u not in schedule.SHARED_MODULES.values() and not (root / u).exists()]
    assert len(stale) <= len(seconds) // 10, stale  # refresh with `python -m tests.helpers.schedule REPORT.xml`
