"""vLLM's `--kv-events-config` JSON (vllm/config/kv_events.py) and its data-parallel port offset."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass
class KVEventsConfig:
    """Same fields, defaults and order as vLLM's KVEventsConfig."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, else "null" (as vLLM)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        _check_type("enable_kv_cache_events", self.enable_kv_cache_events, bool)
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv-events-config: unknown publisher {self.publisher!r} (expected one of {PUBLISHERS})")
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            _check_type(name, value, int)
            if value < 0 or (name == "buffer_steps" and value == 0):
                raise ValueError(f"kv-events-config: {name} must be positive, got {value}")
        _check_type("topic", self.topic, str)

    @property
    def publishes(self) -> bool:
        """Whether a process with this config publishes anything (vLLM: enabled and not the null publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv-events-config is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"kv-events-config must be a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventsConfig:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"kv-events-config: unknown field(s) {unknown} (known: {known})")
        return cls(**data)

    def endpoints_for_rank(self, data_parallel_rank: int) -> tuple[str, str | None]:
        """(PUB endpoint, replay endpoint) of one data-parallel rank's publisher."""
        return (
            offset_endpoint_port(self.endpoint, data_parallel_rank),
            offset_endpoint_port(self.replay_endpoint, data_parallel_rank),
        )


def _check_type(name: str, value: object, kind: type) -> None:
    # bool is an int subclass: refuse true/false for counts, as they are surely a mistake.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"kv-events-config: {name} must be {kind.__name__}, got {value!r}")


def _check_endpoint(name: str, endpoint: object) -> None:
    _check_type(name, endpoint, str)
    assert isinstance(endpoint, str)
    if not endpoint.startswith(_SCHEMES):
        raise ValueError(f"kv-events-config: {name} {endpoint!r} must start with one of {_SCHEMES}")
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"kv-events-config: {name} {endpoint!r} must be tcp://HOST:PORT")


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule: rank 0 keeps the endpoint; a tcp endpoint's port grows by the rank; an inproc
    endpoint gets the suffix `_dp<rank>`; anything else (ipc) is refused for ranks above 0."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" not in endpoint:
            return endpoint
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"cannot offset endpoint {endpoint!r} by a data-parallel rank: needs tcp or inproc")


def binds(endpoint: str) -> bool:
    """vLLM's PUB socket binds a wildcard, IPv6, ipc or inproc endpoint and connects to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
