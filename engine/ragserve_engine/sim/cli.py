"""`ragserve sim-engine`: N simulated engines in one process, each on its own port with its own KV model,
metrics, registration and KV-event stream. Takes `ragserve engine`'s flags (those about weights and kernels are
accepted and ignored) plus the cost model's and --count.

Flags only (cheap to import); the engines run in ragserve_engine.sim.fleet.
"""

from __future__ import annotations

import argparse
import asyncio

from ragserve.engine_args import ENGINE_GROUPS, EngineConfig, ServerConfig
from ragserve.flags import add_options
from ragserve_engine.sim.config import SimConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, (EngineConfig,), ENGINE_GROUPS)
    add_options(parser, (ServerConfig, SimConfig), ("server", "cluster", "sim"))
    parser.set_defaults(num_gpu_blocks=4096, max_model_len=4096, log_level="warning")


def run(args: argparse.Namespace) -> int:
    from ragserve.logs import setup_logging
    from ragserve_engine.sim.fleet import serve

    sim, server, engine = SimConfig.from_args(args), ServerConfig.from_args(args), EngineConfig.from_args(args)
    setup_logging(server.log_level)
    return asyncio.run(serve(sim, server, engine))
