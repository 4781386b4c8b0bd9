"""Flags `ragserve up` passes through to its children (--engine-arg, --router-arg, --cachestore-arg), checked
against each component's own parser (made from its launch spec: ragserve.engine_args, router_args,
cachestore_args), so a typo fails before anything starts, with the component's own message."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ragserve.cachestore_args import add_cachestore_arguments
from ragserve.engine_args import add_engine_arguments, add_server_arguments
from ragserve.router_args import add_router_arguments

PARSERS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], ...]] = {
    "engine": (add_engine_arguments, add_server_arguments),
    "router": (add_router_arguments,),
    "cachestore": (add_cachestore_arguments,),
}


class _Checker(argparse.ArgumentParser):
    """A parser whose errors are raised, not printed with an exit."""

    def error(self, message: str):
        raise ValueError(message)


def parser_for(component: str) -> argparse.ArgumentParser:
    parser = _Checker(prog=f"ragserve {component}", add_help=False)
    for add in PARSERS[component]:
        add(parser)
    return parser


def check_flags(component: str, flags: list[str]) -> None:
    """ValueError naming the --<component>-arg flags that `ragserve <component>` would refuse."""
    if not flags:
        return
    try:
        parser_for(component).parse_args(flags)
    except ValueError as exc:
        raise ValueError(f"--{component}-arg {' '.join(flags)}: ragserve {component} says: {exc}") from None
