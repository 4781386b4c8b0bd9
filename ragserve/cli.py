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
    "generate": ("ragserve_engine.generate_cli", "generate offline from a prompt (no server)"),
    "router": ("ragserve_router.cli", "run the prefix- and KV-aware gateway"),
    "cachestore": ("ragserve_cachestore.cli", "run the shared KV-block store"),
    "up": ("ragserve.stack", "start cachestore, engines and router locally"),
    "demo": ("ragserve.demo", "run the RAG demo client against a router"),
    "operator": ("ragserve_operator.cli", "run the Kubernetes operator"),
    "info": ("ragserve.info", "show a model's metadata and cache identity"),
}


def _available() -> dict[str, tuple[str, str]]:
    out = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            out[name] = (module, help_text)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ragserve",
        description="ragserve: compute each document's KV cache once per cluster, reuse it everywhere.",
    )
    parser.add_argument("--version", action="version", version=f"ragserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _available().items():
        mod = importlib.import_module(module)
        if not hasattr(mod, "add_arguments"):  # a component mid-development must not break the others
            print(f"ragserve: warning: {module} has no add_arguments(); `{name}` is unavailable", file=sys.stderr)
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
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
