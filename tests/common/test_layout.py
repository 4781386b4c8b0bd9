"""The layout rule: import path = file path, and the component seams docs/architecture.md states.

Every module's dotted name is its file path below one source root (the repo root for the core `ragserve`,
the component's folder for the others) and the installed packages resolve there with no renaming.
Router, cachestore, operator and the core never import torch or transformers; the engine never imports
the router. Each package's modules are all imported in one clean interpreter (`python -I`).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers.imports import ROOT, SOURCE_ROOTS, import_graph, module_files

TORCH_FREE = ("ragserve", "ragserve_router", "ragserve_cachestore", "ragserve_operator")
IMPORT_ALL = ROOT / "tests" / "helpers" / "import_all.py"
# what each image leaves out (Dockerfile.engine: core + engine; Dockerfile: core + router, cachestore, operator)
IMAGES = {
    "engine": ("ragserve_router", "ragserve_operator"),
    "torch-free": ("ragserve_engine",),
}
HIDE = """
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {absent}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
"""


@functools.cache
def imported(package: str) -> dict:
    """Every module of `package` imported in a fresh isolated interpreter (see tests/helpers/import_all.py)."""
    argv = [sys.executable, "-I", str(IMPORT_ALL), package, *module_files(package)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, f"importing {package} failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("package", list(SOURCE_ROOTS))
def test_installed_package_resolves_to_its_folder(package):
    assert Path(importlib.util.find_spec(package).origin) == SOURCE_ROOTS[package] / package / "__init__.py"


@pytest.mark.parametrize("package", list(SOURCE_ROOTS))
def test_every_module_imports_from_the_file_its_name_says(package):
    files = module_files(package)
    report = imported(package)
    assert {name: Path(origin) for name, origin in report["origins"].items()} == files
    assert sorted(report["walked"]) == sorted(files), "modules the import system sees that are not files here"


@pytest.mark.parametrize("package", list(SOURCE_ROOTS))
def test_each_distribution_packages_its_own_folder_without_renaming(package):
    root = SOURCE_ROOTS[package]
    assert not (root / "setup.py").exists() and not (root / "setup.cfg").exists()
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools
    assert setuptools["packages"]["find"].get("where", ["."]) == ["."]
    assert setuptools["packages"]["find"]["include"] == [package, f"{package}.*"]


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_packages_never_import_torch(package):
    pulled_by = imported(package)["pulled_by"]
    assert "torch" not in pulled_by, f"{pulled_by['torch']} imports torch"
    assert "transformers" not in pulled_by, f"{pulled_by['transformers']} imports transformers"


def test_engine_never_imports_the_router():
    pulled_by = imported("ragserve_engine")["pulled_by"]
    assert "ragserve_router" not in pulled_by, f"{pulled_by['ragserve_router']} imports the router"


@pytest.mark.parametrize("image", list(IMAGES))
def test_the_cli_parses_where_only_some_components_are_installed(image):
    absent = IMAGES[image]
    code = HIDE.format(absent=absent) + "from ragserve.cli import build_parser; build_parser().parse_args(['info'])"
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]


def distribution(package: str) -> str:
    return tomllib.loads((SOURCE_ROOTS[package] / "pyproject.toml").read_text())["project"]["name"]


def first_party_dependencies(package: str) -> set[str]:
    """The packages of `package`'s distribution and of every first-party distribution it depends on."""
    packages = {distribution(p): p for p in SOURCE_ROOTS}
    seen, todo = set(), [package]
    while todo:
        current = todo.pop()
        seen.add(current)
        project = tomllib.loads((SOURCE_ROOTS[current] / "pyproject.toml").read_text())["project"]
        for requirement in project.get("dependencies", []):
            name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
            if name in packages and packages[name] not in seen:
                todo.append(packages[name])
    return seen


def _optional(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """An import inside `try: ... except ImportError/ModuleNotFoundError` (a component that may be absent)."""
    while node in parents:
        node, child = parents[node], node
        if isinstance(node, ast.Try) and child in node.body:
            names = {ast.unparse(h.type) for h in node.handlers if h.type is not None}
            if names & {"ImportError", "ModuleNotFoundError"}:
                return True
    return False


def first_party_imports(package: str) -> dict[str, str]:
    """{first-party package: the module importing it} for every required import in `package`'s files,
    including those inside functions."""
    found = {}
    for module, path in module_files(package).items():
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in SOURCE_ROOTS and not _optional(node, parents):
                    found.setdefault(top, module)
    return found


@pytest.mark.parametrize("package", list(SOURCE_ROOTS))
def test_a_component_imports_only_what_its_distribution_depends_on(package):
    """An image installs a component with its declared dependencies only: an undeclared first-party import
    (even one inside a function) would fail there at run time."""
    allowed = first_party_dependencies(package)
    used = first_party_imports(package)
    assert set(used) <= allowed, {p: used[p] for p in set(used) - allowed}


ENGINE_SERVER = "ragserve_engine.server"
# what the engine's server may import of the engine: the EngineClient protocol and the values it takes and returns
# (re-exported by engine_client); cli.py hands the server an AsyncLLM, the server never names it
ENGINE_SERVER_MAY_IMPORT = {"ragserve_engine.engine_client"}


def test_the_engine_server_reaches_the_engine_only_through_engine_client():
    """ragserve_engine.server.* imports of ragserve_engine only ragserve_engine.server.* and engine_client,
    counting imports inside functions and under TYPE_CHECKING (tests/helpers/imports.py)."""
    outside = {
        module: sorted(
            name
            for name in imported
            if name.startswith("ragserve_engine.")
            and not name.startswith(ENGINE_SERVER + ".")
            and name not in ENGINE_SERVER_MAY_IMPORT
        )
        for module, imported in import_graph().items()
        if module == ENGINE_SERVER or module.startswith(ENGINE_SERVER + ".")
    }
    outside = {module: names for module, names in outside.items() if names}
    assert not outside, f"the engine server imports engine internals (use EngineClient): {outside}"
