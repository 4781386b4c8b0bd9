"""CLI flags with RAGSERVE_* environment defaults, and byte-size parsing, shared by all components."""

from __future__ import annotations

import argparse
import os
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "t": 1000**4,
    "tb": 1000**4,
}


def parse_bytes(text: str | int) -> int:
    """'4GiB', '512MiB', '1.5GB', '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use e.g. 512MiB, 4GiB, 2GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def env_name(flag: str) -> str:
    return "RAGSERVE_" + flag.lstrip("-").upper().replace("-", "_")


def add_flag(parser: argparse.ArgumentParser, flag: str, **kwargs) -> argparse.Action:
    """parser.add_argument whose default can come from RAGSERVE_<FLAG> in the environment."""
    env = os.environ.get(env_name(flag))
    if env is not None:
        if kwargs.get("action") in ("store_true", argparse.BooleanOptionalAction):
            kwargs["default"] = _env_bool(flag, env)
        else:
            kwargs["default"] = kwargs.get("type", str)(env) if "type" in kwargs else env
    if "help" in kwargs and kwargs.get("default") not in (None, argparse.SUPPRESS, False):
        kwargs["help"] += " (default: %(default)s)"
    kwargs["help"] = kwargs.get("help", "") + f" [env {env_name(flag)}]"
    return parser.add_argument(flag, **kwargs)


def _env_bool(flag: str, value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise SystemExit(f"ragserve: error: {env_name(flag)}={value!r} is not a boolean (use true/false)")


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value
