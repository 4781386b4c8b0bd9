"""Moved to ragserve.engine_args (torch-free core: the operator and the chart use it too).

Kept only while importers outside the engine's own modules move over; delete it then.
"""

from ragserve.engine_args import ServerConfig, add_server_arguments

__all__ = ["ServerConfig", "add_server_arguments"]
