"""`ragserve engine`: flags here (cheap to import: no torch), the server in ragserve_engine.server.launcher."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ragserve.engine_args import add_engine_arguments, add_server_arguments

    add_engine_arguments(parser)
    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ragserve.engine_args import EngineConfig, ServerConfig
    from ragserve_engine.server.launcher import serve

    engine_config = EngineConfig.from_args(args)
    server_config = ServerConfig.from_args(args)
    return serve(engine_config, server_config)
