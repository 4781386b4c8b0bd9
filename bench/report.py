"""What every benchmark's result files share: the commit and command they came from, and how they are written
(bench/results/STEM.json with the raw runs, STEM.md with the table, the table printed too)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def provenance(script: str) -> dict[str, str]:
    """command (as run), commit (short HEAD) and date (UTC) for a report."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = f"python bench/{script} " + " ".join(sys.argv[1:])
    return {"command": command.strip(), "commit": commit, "date": time.strftime("%Y-%m-%d", time.gmtime())}


def write(out: str | Path, stem: str, report: dict, markdown: str) -> None:
    out = Path(out)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    print(markdown)


def rotated(names: list, rep: int) -> list:
    """The order of repeat `rep` when configurations are interleaved: a different one first each time."""
    k = rep % len(names)
    return names[k:] + names[:k]


def medians(runs: list[dict], keys: tuple[str, ...]) -> dict[str, float]:
    """The median over repeats of each of `keys`."""
    return {k: statistics.median(r[k] for r in runs) for k in keys}
