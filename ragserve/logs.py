"""Process logging for every ragserve command: one format, one place."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error")  # every command's --log-level choices


def setup_logging(level: str) -> None:
    """Root logging at `level` ("debug", "INFO", ...: case does not matter) in the shared format."""
    logging.basicConfig(level=level.upper(), format=FORMAT)
