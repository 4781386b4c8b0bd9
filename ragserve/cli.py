"""The `ragserve` command. Each subcommand lives in its component's `cli` module,
which exposes `add_arguments(parser)` (torch-free) and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from ragserve import __version__

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("ragserve_engine.cli", "run an inference engine with an OpenAI-compatible API"),
    "sim-engine": ("ragserve_engine.sim.cli", "run simulated engines (scale benchmarks and load tests only)"),
    "generate": ("ragserve_engine.generate_cli", "generate offline from a prompt (no server)"),
    "router": ("ragserve_router.cli", "run the prefix- and KV-aware gateway"),
    "cachestore": ("ragserve_cachestore.cli", "run the shared KV-block store"),
    "up": ("ragserve.stack", "start cachestore, engines and router locally"),
    "demo": ("ragserve.demo", "run the RAG demo client against a router"),
    "operator": ("ragserve_operator.cli", "run the Kubernetes operator"),
    "info": ("ragserve.info", "show a model's metadata and cache identity"),
}


def _unavailable(module: str) -> str | None:
    """Why `module` cannot serve its subcommand (not installed, fails to import, no add_arguments), or None."""
    try:
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(module)
    except ModuleNotFoundError:
        return f"not installed (pip install {module.split('.')[0].replace('_', '-')})"
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:  # a component with a broken dependency must not hide the others
        return f"{module} fails to import: {exc}"
    if not hasattr(mod, "add_arguments"):
        return f"{module} has no add_arguments()"
    return None


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand is listed; one whose component cannot load says why and fails when run."""
    parser = argparse.ArgumentParser(
        prog="ragserve",
        description="ragserve: compute each document's KV cache once per cluster, reuse it everywhere.",
    )
    parser.add_argument("--version", action="version", version=f"ragserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        reason = _unavailable(module)
        if reason:
            p = sub.add_parser(name, help=f"{help_text} [unavailable: {reason}]", add_help=False)
            p.set_defaults(_unavailable=reason)
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)  # an unavailable subcommand's flags are unknown here
    if unknown and not getattr(args, "_unavailable", None):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(f"ragserve {args.command}: error: unavailable: {args._unavailable}", file=sys.stderr)
        return 2
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as exc:
        print(f"ragserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
