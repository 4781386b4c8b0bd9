"""Import every module of one package in this (fresh) interpreter and report, as JSON on stdout, where each
module was found, what pkgutil sees, and which module first pulled in each watched heavy dependency.

    python -I tests/helpers/import_all.py PACKAGE MODULE [MODULE ...]  # MODULEs: dotted names to import

Run by tests/common/test_layout.py in a clean subprocess (no torch or test code imported beforehand).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
import sys

WATCHED = ("torch", "transformers", "ragserve_router")


def import_all(package: str, names: list[str]) -> dict:
    origins: dict[str, str | None] = {}
    pulled_by: dict[str, str] = {}
    for name in names:
        origins[name] = importlib.util.find_spec(name).origin
        importlib.import_module(name)
        for heavy in WATCHED:
            if heavy in sys.modules:
                pulled_by.setdefault(heavy, name)
    root = sys.modules[package]
    walked = [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]
    return {"origins": origins, "walked": [package, *walked], "pulled_by": pulled_by}


def main() -> None:
    package, *names = sys.argv[1:]
    print(json.dumps(import_all(package, names)))


if __name__ == "__main__":
    main()
