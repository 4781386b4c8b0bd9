"""`ragserve engine`: flags here (cheap to import: no torch), the server in ragserve_engine.server.launcher."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

from ragserve_engine.compilation.events import COMPILE_THREAD

if TYPE_CHECKING:
    from ragserve.engine_args import EngineConfig
    from ragserve_engine.engine_client import EngineClient


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ragserve.engine_args import add_engine_arguments, add_server_arguments

    add_engine_arguments(parser)
    add_server_arguments(parser)


def start_engine(config: EngineConfig) -> EngineClient:
    """The engine the server serves, an AsyncLLM, or an AsyncPooler with --task embed (the server itself knows only
    EngineClient)."""
    if config.task == "embed":
        from ragserve_engine.pooling.engine import AsyncPooler

        return AsyncPooler(config)
    from ragserve_engine.async_engine import AsyncLLM  # torch and the model: only once serving

    return AsyncLLM(config)


def run(args: argparse.Namespace) -> NoReturn:
    from ragserve.engine_args import EngineConfig, ServerConfig

    engine_config = EngineConfig.from_args(args)  # bad flags exit 2 here, before torch loads (~1.5 s)
    server_config = ServerConfig.from_args(args)
    from ragserve_engine.server.launcher import serve

    code = serve(engine_config, server_config, start_engine)
    if any(t.name == COMPILE_THREAD and t.is_alive() for t in threading.enumerate()):
        # drained and deregistered, but a decode graph is still compiling (a cold SmolLM2 graph takes over
        # a minute): it cannot be interrupted, and interpreter teardown under it aborts the process
        logging.getLogger(__name__).info("exiting with a decode graph compile in flight (it is abandoned)")
        logging.shutdown()
        os._exit(code)
    _exit_without_teardown(code)


def _exit_without_teardown(code: int) -> NoReturn:
    """Drained and stopped: run the exit handlers (logs and traces flushed, worker pools stopped) and end the process
    without the interpreter's teardown, which frees torch, the model and the KV cache one object at a time."""
    threading._shutdown()  # what interpreter exit does first: pools' queued work finished, their threads joined
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
