"""`ragserve router`: flags in ragserve.router_args (cheap to import), the server in ragserve_router.server."""

from __future__ import annotations

import argparse
import asyncio

from ragserve.router_args import RouterConfig, add_router_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_router_arguments(parser)


def run(args: argparse.Namespace) -> int:
    cfg = RouterConfig.from_args(args)
    from ragserve_router.server import serve

    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(serve(cfg))


def _loop_factory():
    """uvloop where it is installed (the router's dependency on Linux and macOS), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
