"""The first-party packages' module files and the imports between them, read from source with `ast`.

An edge A -> B is any `import` statement in A naming B, wherever it stands: at the top, inside a function,
under `if TYPE_CHECKING:` or in a `try`. Relative imports resolve against A's package. `from P import n`
is an edge to the submodule P.n when that is a module file, else to P itself (its `__init__`); `import P`
and `import P.m` are edges to P and P.m only. The parent packages Python runs on the way (`P/__init__` for
`import P.m`) are not edges: they are not something the importing module asks for.
`importlib.import_module(variable)` (the CLI's subcommand table) is data, not an edge.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# each package's source root: the repo root for the core, the component's folder for the others
SOURCE_ROOTS = {
    "ragserve": ROOT,
    "ragserve_engine": ROOT / "engine",
    "ragserve_router": ROOT / "router",
    "ragserve_cachestore": ROOT / "cachestore",
    "ragserve_operator": ROOT / "operator",
}


def module_files(package: str) -> dict[str, Path]:
    """{dotted name: file} for every module file of `package`, named by its path below the source root
    (a package's `__init__` by the package)."""
    root = SOURCE_ROOTS[package]
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


@functools.cache
def all_module_files() -> dict[str, Path]:
    return {name: path for package in SOURCE_ROOTS for name, path in module_files(package).items()}


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name `from <node.module> import ...` refers to, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    package = (module if path.name == "__init__.py" else module.rpartition(".")[0]).split(".")
    if node.level - 1 >= len(package):
        raise ValueError(f"{path}:{node.lineno}: relative import beyond the top-level package")
    parts = package[: len(package) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _targets(module: str, path: Path, node: ast.AST, known: dict[str, Path]) -> list[str]:
    """The first-party modules one import statement names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = _base(module, path, node)
    found = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in known:
            found.append(submodule)
        elif base in known:
            found.append(base)
    return found


def imports_of(module: str, path: Path, source: str, known: dict[str, Path]) -> frozenset[str]:
    """The modules of `known` that `module` (at `path`, with this source) imports anywhere."""
    tree = ast.parse(source, filename=str(path))
    return frozenset(t for node in ast.walk(tree) for t in _targets(module, path, node, known))


@functools.cache
def import_graph() -> dict[str, frozenset[str]]:
    """{module: the first-party modules it imports}, for every module of the packages."""
    known = all_module_files()
    return {module: imports_of(module, path, path.read_text(), known) for module, path in known.items()}
