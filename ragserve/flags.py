"""CLI flags with RAGSERVE_* environment defaults, and byte-size parsing, shared by all components.

A dataclass field made with `option()` is also a CLI flag: `add_options()` turns each into
--<field-name> with the field's default, help, type and choices, so a default is written once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

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


# A TCP port's JSON-schema bounds (the RAGServe CRD's ports).
PORT_SCHEMA = {"minimum": 1, "maximum": 65535}
# The largest gRPC message a ragserve server (router registry, cachestore) or client takes by default.
GRPC_MAX_MESSAGE = "64MiB"


# What parse_bytes() accepts, as a JSON-schema pattern (the RAGServe CRD's sizes).
SIZE_PATTERN = r"^[0-9]*\.?[0-9]+ *([kKmMgGtT]([iI]?[bB])?|[bB])?$"


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
    if env is not None and kwargs.get("action") == "append":  # a repeatable flag: ';'-separated values
        kwargs["default"] = [kwargs.get("type", str)(v.strip()) for v in env.split(";") if v.strip()]
    elif env is not None:
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


def cpu_list(text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """taskset's CPU list: '0' or '0,2-3' -> (0, 2, 3)."""
    if isinstance(text, tuple | list):
        return tuple(sorted({int(c) for c in text}))
    cpus: set[int] = set()
    for part in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if not match or int(match.group(2) or match.group(1)) < int(match.group(1)):
            raise argparse.ArgumentTypeError(f"invalid CPU list {text!r}: use e.g. 0 or 0,2-3")
        cpus.update(range(int(match.group(1)), int(match.group(2) or match.group(1)) + 1))
    return tuple(sorted(cpus))


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def option(
    default: Any,
    help: str,
    group: str,
    *,
    type: Callable[[str], Any] | None = None,
    choices: tuple | None = None,
    spec: bool = False,
    schema: dict[str, Any] | None = None,
    negatable: bool = True,
    repeat: bool = False,
) -> Any:
    """A dataclass field that is also the flag --<field-name> in argument group `group` (a bool field gets
    --no-<flag> too, unless not `negatable`: then a plain switch). A list default is copied for each instance.
    `spec`: also a camelCase setting of the RAGServe CRD and the chart's values, with `schema`'s JSON-schema
    keywords added to what the type and choices say (e.g. an enum checked after parsing). `repeat`: the flag
    may be given several times (a list default, one `type` value each; its variable holds ';'-separated values)."""
    metadata = {"help": help, "group": group, "type": type, "choices": choices, "spec": spec, "schema": schema or {}}
    metadata["negatable"] = negatable
    metadata["repeat"] = repeat
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def default_of(f: dataclasses.Field) -> Any:
    """An option's default value (a fresh copy of a list default)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def flag_of(name: str) -> str:
    """Field name -> flag: block_size -> --block-size."""
    return "--" + name.replace("_", "-")


def options(cls: type) -> list[dataclasses.Field]:
    """The fields of a dataclass that are flags (made with option())."""
    return [f for f in dataclasses.fields(cls) if "group" in f.metadata]


def add_options(parser: argparse.ArgumentParser, classes: tuple[type, ...], groups: tuple[str, ...]) -> None:
    """One argument group per name in `groups`, holding the option() fields of `classes` in that group."""
    for group in groups:
        g = parser.add_argument_group(group)
        for cls in classes:
            for f in options(cls):
                if f.metadata["group"] == group:
                    add_flag(g, flag_of(f.name), **_argparse_kwargs(f))


def _argparse_kwargs(f: dataclasses.Field) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"default": default_of(f), "help": f.metadata["help"]}
    if f.metadata.get("repeat"):
        kwargs["action"] = "append"  # argparse appends to a copy of the default
    if isinstance(f.default, bool):
        kwargs["action"] = argparse.BooleanOptionalAction if f.metadata["negatable"] else "store_true"
    for key in ("type", "choices"):
        if f.metadata[key] is not None:
            kwargs[key] = f.metadata[key]
    return kwargs


def spec_key(name: str) -> str:
    """Field name -> its camelCase key in the RAGServe CRD and the chart's values: block_size -> blockSize."""
    first, *rest = name.split("_")
    return first + "".join(part.capitalize() for part in rest)


def spec_fields(cls: type) -> list[tuple[str, dataclasses.Field]]:
    """(camelCase key, field) of every spec=True option of `cls` (what a RAGServe CR sets), in field order."""
    return [(spec_key(f.name), f) for f in options(cls) if f.metadata["spec"]]


class FromArgs:
    """Mixin for option() dataclasses: build one from parsed flags (fields without a flag keep defaults)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Any:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def check_choices(self) -> None:
        """Raise ValueError for an option() field outside its choices (for configs built in code, not by flags)."""
        for f in options(type(self)):
            choices = f.metadata["choices"]
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {tuple(choices)}, got {getattr(self, f.name)!r}")
