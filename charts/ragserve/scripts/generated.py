"""The chart's generated files: write one, or (--check) say it is stale, for the gen_*.py scripts here."""

from __future__ import annotations

from pathlib import Path


def write_or_check(path: Path, text: str, check: bool, fix: str) -> int:
    """Exit status: with `check`, 1 (printing `fix`) if `path` does not hold `text`; else write it."""
    if check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is stale: {fix}")
            return 1
        return 0
    path.write_text(text)
    return 0
