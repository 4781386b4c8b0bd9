"""`ragserve up`: a local stack (Redis, cachestore, router, N engines) as child processes on loopback."""

from ragserve.stack.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
