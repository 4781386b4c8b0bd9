"""`ragserve engine`: flags here (cheap to import: no torch), the server in ragserve_engine.server.server."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ragserve_engine.config import add_engine_arguments
    from ragserve_engine.server.config import add_server_arguments

    add_engine_arguments(parser)
    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ragserve_engine.config import EngineConfig
    from ragserve_engine.server.config import ServerConfig
    from ragserve_engine.server.server import serve

    engine_config = EngineConfig.from_args(args)
    server_config = ServerConfig.from_args(args)
    return serve(engine_config, server_config)
